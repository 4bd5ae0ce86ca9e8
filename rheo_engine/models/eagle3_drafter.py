"""The EAGLE-3 head as a tree drafter (draft.Drafter + commit; docs/eagle3_format.md §8), for a
batch of sequences of different lengths (one sequence alone is a batch of one).

Each sequence's committed pairs (target feature of token j, token j + 1) live at RoPE position
j in its slot of a SlotPool (one layer; the slots are the target pool's, handed out by the
decoder). Tree levels are scratch: level l runs its frontier nodes at position m + l - 1
(m = the sequence's committed pairs), each seeing the committed pairs, its ancestors among
earlier frontier nodes and itself; their K/V is dropped at commit, where the accepted pairs are
recomputed from the target's features, as EAGLE does. On the CPU's fused path the levels' K/V
goes into the slot's rows after its m (``TREE_ROWS`` scratch rows past max_len keep room for a
tree) and the tree attention kernel reads the slot in place: a level copies nothing of the
committed rows (Eagle3Head.layer_in_pool); a commit's pairs likewise attend in place. Elsewhere
(CUDA, the torch path) the levels' K/V is kept beside the committed rows, which each level
gathers. A step's
head forwards run over the batch with per-sequence positions and masks that hide the rows past
each sequence's own m.

Commits are lazy: a step's accepted pairs (and the prompt's) wait until the sequence next
drafts (root_logits) and then run in one forward with any others waiting. A run of plain steps
(the cost model's choice when no tree pays) thus costs the head nothing until speculation
resumes, and then one forward over all the pairs it missed, not one per step. Sequences join
(``prefill`` into a fresh slot) and leave (``release``) between steps; ``begin(slots)`` says
which run the next step, in which order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.spec import kernels
from rheo_engine.spec.verify import Outcome


class Eagle3Drafter:
    """Drafting state of up to ``slots`` sequences of up to ``max_len`` pairs each over one
    Eagle3Head. Until ``begin`` names others, a step runs slots 0..slots-1 in order (one
    sequence: ``Eagle3Drafter(head, max_len)`` and no slot arguments at all)."""

    # Rows of each slot past max_len for a tree's levels (the in-pool path): a tree of more
    # expanded nodes than the room left after a slot's m continues on the gathered path.
    TREE_ROWS = 128

    def __init__(self, head: Eagle3Head, max_len: int, slots: int = 1) -> None:
        if max_len < 1 or slots < 1:
            raise ValueError(f"max_len={max_len} and slots={slots} must be >= 1")
        c = head.cfg
        self.head = head
        # committed pairs at 0..m-1; the in-pool path's tree rows after them
        self.pool = head.new_pool(max_len + self.TREE_ROWS, slots)
        self.max_len = max_len
        self._last_h = torch.zeros(slots, c.hidden_size, dtype=head.dtype, device=head.device)
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(slots)]
        self._pending_rows = [0] * slots
        # slot -> (its m, the draft logits [1, Vd] of its last pair): the one-call flush of a
        # sequence's waiting pairs (_append_one) computes them with its layer, for root_logits
        self._root: dict[int, tuple[int, torch.Tensor]] = {}
        self.slots: list[int] = list(range(slots))  # the batch of the current step
        self._level = -1  # last level expanded; 0 right after root_logits, -1 before
        self._in_pool = False  # this tree's levels in the slots (root_logits decides)
        self._eye: dict[int, torch.Tensor] = {}  # k -> eye(k) bool: a level's own nodes

    def waiting(self, slot: int = 0) -> int:
        """Pairs of a slot queued since the head last ran: its next draft runs them first."""
        return self._pending_rows[slot]

    def length(self, slot: int = 0) -> int:
        """m of a slot: its committed pairs, those waiting to run included."""
        return self.pool.lengths[slot] + self._pending_rows[slot]

    def _queue(self, slot: int, features: torch.Tensor, tokens: torch.Tensor) -> None:
        n = features.shape[0]
        if self.length(slot) + n > self.max_len:
            raise ValueError(
                f"the draft head needs {self.length(slot) + n} rows but a slot holds "
                f"max_len={self.max_len}; raise max_len / shorten the prompt"
            )
        self._pending[slot].append((features, tokens.long()))
        self._pending_rows[slot] += n

    def prefill(
        self, features: torch.Tensor, next_tokens: torch.Tensor, slots: list[int] | None = None
    ) -> None:
        """Queue pairs (features [B, L, F] of token j, target ids next_tokens [B, L] of token
        j + 1) at the next L positions of each of ``slots`` (default: the step's); the first
        call holds the prompt's pairs. Like a commit, they run when the head next drafts (a
        request of plain steps never runs it)."""
        slots = self.slots if slots is None else slots
        F_in, B = len(self.head.feature_layers) * self.head.cfg.target_hidden_size, len(slots)
        if features.dim() != 3 or features.shape[0] != B or features.shape[2] != F_in:
            raise ValueError(
                f"features must be [B={B}, L, F={F_in}] (len(feature_layers) * target hidden), "
                f"got {list(features.shape)}; pass the target's features for feature_layers"
            )
        if tuple(next_tokens.shape) != tuple(features.shape[:2]):
            raise ValueError(
                f"next_tokens must be [B, L] = {list(features.shape[:2])} (one per feature), "
                f"got {list(next_tokens.shape)}"
            )
        for b, slot in enumerate(slots):
            self._queue(slot, features[b], next_tokens[b])
        self._level = -1

    def release(self, slot: int) -> None:
        """Forget a finished sequence's pairs, so that the slot starts empty for the next one
        (the slots are the target pool's: the decoder hands them out)."""
        self._pending[slot], self._pending_rows[slot] = [], 0
        self.pool.lengths[slot] = 0
        self._root.pop(slot, None)

    def begin(self, slots: list[int]) -> None:
        """The sequences of the next step, in batch order."""
        self.slots = list(slots)
        self._level = -1

    @torch.no_grad()
    def _flush(self) -> None:
        """Run the waiting pairs of the step's sequences in one head forward, padded to the
        longest (padded pairs see only real rows, write the slot's scratch row, and are
        dropped)."""
        waiting, feats, toks, counts = self.take_waiting()
        if waiting:
            self.append(waiting, feats, toks, counts)

    def take_waiting(self) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[int]]:
        """The step's sequences with pairs waiting, and their features [c, F], next tokens [c]
        and counts c; the queues are emptied (the caller runs them: append, or the static
        buffers' commit in runtime/graphs.StaticDraft)."""
        waiting = [s for s in self.slots if self._pending[s]]
        feats, toks, counts = [], [], []
        for s in waiting:  # (a plain step's pair is queued as [1, 1, F] and [1]: commit)
            pairs = self._pending[s]
            feats.append(torch.cat([f.view(-1, f.shape[-1]) for f, _ in pairs], 0))
            toks.append(torch.cat([t.view(-1) for _, t in pairs], 0).long())
            counts.append(feats[-1].shape[0])
            self._pending[s], self._pending_rows[s] = [], 0
        return waiting, feats, toks, counts

    def append(self, waiting: list[int], feats: list[torch.Tensor], toks: list[torch.Tensor],
               counts: list[int]) -> None:  # fmt: skip
        """Run the pairs take_waiting gave in one head forward (eagerly)."""
        dev, head = self.head.device, self.head
        if len(waiting) == 1:  # one sequence: slices of its slot, no padding (as one cache)
            self._append_one(waiting[0], feats[0], toks[0])
            return
        for s in waiting:
            self._root.pop(s, None)
        n = max(counts)
        features = torch.stack([F.pad(f, (0, 0, 0, n - f.shape[0])) for f in feats])
        tokens = torch.stack([F.pad(t, (0, n - t.shape[0])) for t in toks])
        B = len(waiting)
        m = [self.pool.lengths[s] for s in waiting]
        m_max = max(m)
        i32 = dict(dtype=torch.long, device=dev)
        m_dev = torch.tensor(m, **i32).view(B, 1)
        count_dev = torch.tensor(counts, **i32).view(B, 1)
        j = torch.arange(n, **i32).view(1, n)
        positions = m_dev + j  # [B, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(B, n, n)
        slots = torch.tensor(waiting, **i32).view(B, 1)
        h = head.fuse(features.to(dev))
        if head.attends_in_pool() and m_max + n <= self.pool.k.shape[2]:
            # each sequence's n rows after its m (padding too: rows past its new length, which
            # only its padding pairs see), attended in place: nothing gathered
            i32_ = dict(dtype=torch.int32, device=dev)
            h2 = head.layer_in_pool(
                h, tokens.to(dev), positions, self.pool.k[0], self.pool.v[0], (slots, positions),
                causal.to(torch.uint8).contiguous(), m_max, torch.tensor(m, **i32_),
                torch.tensor(waiting, **i32_),
            )  # fmt: skip
        else:
            seen = torch.arange(m_max, **i32).view(1, 1, m_max) < m_dev.view(B, 1, 1)
            mask = torch.cat((seen.expand(B, n, m_max), causal), 2)
            past_k = self.pool.k[0, slots, torch.arange(m_max, **i32).view(1, m_max)]
            past_v = self.pool.v[0, slots, torch.arange(m_max, **i32).view(1, m_max)]
            h2, k, v = head.layer(h, tokens.to(dev), positions, past_k, past_v, mask)
            rows = torch.where(j < count_dev, positions, self.max_len)  # padding: scratch row
            self.pool.k[0, slots, rows] = k
            self.pool.v[0, slots, rows] = v
        last = torch.tensor(counts, **i32) - 1
        self._last_h[slots.view(B)] = h2[torch.arange(B, device=dev), last]
        for s, c in zip(waiting, counts, strict=True):
            self.pool.lengths[s] += c

    @torch.no_grad()
    def append_static(self, slots: torch.Tensor, m: torch.Tensor, counts: torch.Tensor,
                      features: torch.Tensor, tokens: torch.Tensor,
                      rows: torch.Tensor) -> None:  # fmt: skip
        """append on device buffers, for a captured commit (runtime/graphs.StaticDraft):
        ``slots``, ``m`` (committed pairs) and ``counts`` (pairs to add) [B] long on the device,
        ``features`` [B, n, F] and ``tokens`` [B, n] with each sequence's pairs first and
        padding after, ``rows`` = arange(max_len) [1, max_len]. Each sequence attends over its
        whole slot with the rows past its m masked, so every shape follows from B, n and
        max_len. The caller adds the counts to pool.lengths."""
        B, n = tokens.shape
        head, L = self.head, self.max_len
        self._root.clear()
        j = rows[:, :n]
        positions = m.view(B, 1) + j
        seen = (rows.view(1, 1, L) < m.view(B, 1, 1)).expand(B, n, L)
        causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril().expand(B, n, n)
        k_all, v_all = self.pool.k[0].index_select(0, slots), self.pool.v[0].index_select(0, slots)
        h2, k, v = head.layer(head.fuse(features), tokens, positions, k_all[:, :L], v_all[:, :L],
                              torch.cat((seen, causal), 2))  # fmt: skip
        written = torch.where(j < counts.view(B, 1), positions, L)  # padding: the scratch row
        self.pool.k[0, slots.view(B, 1), written] = k
        self.pool.v[0, slots.view(B, 1), written] = v
        self._last_h[slots] = h2[torch.arange(B, device=tokens.device), counts - 1]

    def _append_one(self, slot: int, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """_flush of a single sequence: its n pairs see its m committed ones, then causally."""
        dev, head, n = self.head.device, self.head, features.shape[0]
        m = self.pool.lengths[slot]
        positions = (m + torch.arange(n, device=dev)).view(1, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        k_slot, v_slot = self.pool.k[0, slot : slot + 1], self.pool.v[0, slot : slot + 1]
        h = head.fuse(features.to(dev).unsqueeze(0))
        self._root.pop(slot, None)
        if head.attends_in_pool():  # rows m..m+n-1, attended in place (m + n <= max_len)
            mask, tokens = causal.to(torch.uint8).view(1, n, n), tokens.to(dev).view(1, n)
            # in one call with the last pair's logits (the next root's), where it applies
            one = head.level_one_call(h, tokens, positions, self.pool, slot, m, m, mask, 1)
            if one is not None:
                h2 = one[0]
                self._root[slot] = (m + n, one[1][:, 0])
            else:
                h2 = head.layer_in_pool(h, tokens, positions, k_slot, v_slot,
                                        (slice(None), slice(m, m + n)), mask, m)  # fmt: skip
        else:
            mask = torch.cat((torch.ones(n, m, dtype=torch.bool, device=dev), causal), 1)
            h2, k, v = head.layer(h, tokens.to(dev).view(1, n), positions, k_slot[:, :m],
                                  v_slot[:, :m], mask.view(1, n, -1))  # fmt: skip
            k_slot[:, m : m + n], v_slot[:, m : m + n] = k, v
        self._last_h[slot] = h2[0, -1]
        self.pool.lengths[slot] += n

    @torch.no_grad()
    def root_logits(self) -> torch.Tensor:
        """Draft logits [B, Vd] of each root's children; gathers the step's committed rows."""
        self._flush()
        dev, B = self.head.device, len(self.slots)
        empty = [s for s in self.slots if self.pool.lengths[s] == 0]
        if empty:
            raise ValueError(
                f"root_logits() before any pair of slot {empty[0]}: call prefill(features, "
                "next_tokens) first"
            )
        m = [self.pool.lengths[s] for s in self.slots]
        m_max = max(m)
        i64 = dict(dtype=torch.long, device=dev)
        self._tree_mask = torch.zeros(B, 1, 0, dtype=torch.bool, device=dev)
        self._level = 0
        if self.head.attends_in_pool():  # the levels' rows go into the slots (expand)
            self._in_pool, self._m_list = True, m
            if B == 1:  # a slice of the slot, and nothing uploaded
                s = self.slots[0]
                self._m, self._pool_args = m_max, None
                self._frontier_h = self._last_h[s : s + 1].unsqueeze(1)  # [1, 1, H]
                kept = self._root.pop(s, None)  # once: a caller may write into it
                if kept is not None and kept[0] == m_max:  # the flush's (the same bits)
                    return kept[1]
            else:
                self._m = torch.tensor(m, **i64).view(B, 1)
                slots_i32 = torch.tensor(self.slots, dtype=torch.int32, device=dev)
                self._pool_args = (slots_i32, torch.tensor(m, dtype=torch.int32, device=dev))
                self._frontier_h = self._last_h[slots_i32.long()].unsqueeze(1)  # [B, 1, H]
            return self.head.logits(self._frontier_h[:, 0])
        self._in_pool = False
        self._gather_committed(m)
        c = self.head.cfg
        self._tree_k = self._tree_v = torch.zeros(
            B, 0, c.num_key_value_heads, c.head_dim, dtype=self.head.dtype, device=dev
        )
        return self.head.logits(self._frontier_h[:, 0])

    def _gather_committed(self, m: list[int]) -> None:
        """The gathered path's state: the step's committed rows [B, m_max] and which of them
        each sequence sees, its m, and each root's h."""
        dev, B, m_max = self.head.device, len(self.slots), max(m)
        i64 = dict(dtype=torch.long, device=dev)
        if B == 1:  # views of the slot, and nothing uploaded
            s = self.slots[0]
            self._m = m_max
            self._committed_k = self.pool.k[0, s : s + 1, :m_max]
            self._committed_v = self.pool.v[0, s : s + 1, :m_max]
            self._seen = torch.ones(1, m_max, dtype=torch.bool, device=dev)
            self._frontier_h = self._last_h[s : s + 1].unsqueeze(1)  # [1, 1, H]
        else:
            slots = torch.tensor(self.slots, **i64).view(B, 1)
            rows = torch.arange(m_max, **i64).view(1, m_max)
            self._m = torch.tensor(m, **i64).view(B, 1)
            self._committed_k = self.pool.k[0, slots, rows]  # [B, m_max, Hkv, D]
            self._committed_v = self.pool.v[0, slots, rows]
            self._seen = rows < self._m  # [B, m_max]: the rows each sequence sees
            self._frontier_h = self._last_h[slots.view(B)].unsqueeze(1)  # [B, 1, H]

    def _leave_pool(self) -> None:
        """Continue a tree on the gathered path: its level rows so far, read from the slots."""
        dev, B, S = self.head.device, len(self.slots), self._tree_mask.shape[2]
        h = self._frontier_h
        self._gather_committed(self._m_list)
        self._frontier_h = h
        slots = torch.tensor(self.slots, dtype=torch.long, device=dev).view(B, 1)
        rows = torch.tensor(self._m_list, dtype=torch.long, device=dev).view(B, 1)
        rows = rows + torch.arange(S, dtype=torch.long, device=dev).view(1, S)
        self._tree_k, self._tree_v = self.pool.k[0, slots, rows], self.pool.v[0, slots, rows]
        self._in_pool = False

    @torch.no_grad()
    def static_root_logits(self, slots: torch.Tensor, m: torch.Tensor,
                           rows: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """root_logits on device buffers, for a captured draft loop: ``slots`` [B] long and
        ``m`` [B] (committed pairs, flushed) on the device, ``rows`` = arange(max_len) [1, max_len].
        Each sequence attends over its whole slot with the rows past its m masked, so every
        shape follows from B and max_len and nothing is read back (the eager root_logits
        slices to the longest m instead: the same rows seen, another summation length)."""
        B = slots.shape[0]
        self._m = m.long().view(B, 1)
        k, v = self.pool.k[0].index_select(0, slots), self.pool.v[0].index_select(0, slots)
        self._committed_k, self._committed_v = k[:, : self.max_len], v[:, : self.max_len]
        self._seen = rows < self._m  # [B, max_len]
        self._in_pool = False
        self._frontier_h = self._last_h.index_select(0, slots).unsqueeze(1)  # [B, 1, H]
        c = self.head.cfg
        self._tree_k = self._tree_v = k.new_zeros(B, 0, c.num_key_value_heads, c.head_dim)
        self._tree_mask = torch.zeros(B, 1, 0, dtype=torch.bool, device=k.device)
        self._level = 0
        return self.head.logits(self._frontier_h[:, 0])

    @torch.no_grad()
    def expand(self, level: int, parent_rank: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, k, Vd] after each level-``level`` node (tokens [B, k], TARGET ids),
        sequence b at position m_b + level - 1.

        Node j continues the node of rank parent_rank[b, j] expanded at the previous call: its
        pair is (that node's h2, embedding of its own token)."""
        self._check_expand(level, parent_rank, tokens)
        B, k = tokens.shape
        H, dev = self.head.cfg.hidden_size, self.head.device
        if B == 1 and self._in_pool and isinstance(self._m, int):
            logits = self._expand_one(level, parent_rank, tokens)
            if logits is not None:
                return logits
        rank = parent_rank.to(dev).long()
        h = self._frontier_h.gather(1, rank.unsqueeze(2).expand(B, k, H))
        S = self._tree_mask.shape[2]
        ancestors = self._tree_mask.gather(1, rank.unsqueeze(2).expand(B, k, S))
        own = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)
        tree_mask = torch.cat((ancestors, own), 2)
        if isinstance(self._m, int):  # one sequence
            positions = torch.full((B, k), self._m + level - 1, dtype=torch.long, device=dev)
        else:
            positions = (self._m + (level - 1)).expand(B, k)
        if self._in_pool and max(self._m_list) + S + k > self.pool.k.shape[2]:
            self._leave_pool()  # no room left after some slot's m: gather from here on
        if self._in_pool:
            h2 = self._expand_in_pool(h, tokens.to(dev).long(), positions, tree_mask, S)
            self._tree_mask, self._frontier_h, self._level = tree_mask, h2, level
            return self.head.logits(h2)
        m_max = self._seen.shape[1]
        mask = torch.cat((self._seen.view(B, 1, m_max).expand(B, k, m_max), tree_mask), 2)
        h2, k_new, v_new = self.head.layer(
            h, tokens.to(dev).long(), positions,
            torch.cat((self._committed_k, self._tree_k), 1),
            torch.cat((self._committed_v, self._tree_v), 1), mask,
        )  # fmt: skip
        self._tree_k = torch.cat((self._tree_k, k_new), 1)
        self._tree_v = torch.cat((self._tree_v, v_new), 1)
        self._tree_mask, self._frontier_h, self._level = tree_mask, h2, level
        return self.head.logits(h2)

    def _expand_one(self, level: int, parent_rank: torch.Tensor,
                    tokens: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        """expand for one sequence in its slot, in one C++ call (Eagle3Head.level_one_call),
        with a third of the general path's operators (a level at one node spent ~40% of its
        time in them); None where that call does not apply (then the general path runs)."""
        k, dev = tokens.shape[1], self.head.device
        S, m, s = self._tree_mask.shape[2], self._m, self.slots[0]
        if m + S + k > self.pool.k.shape[2]:
            return None
        rank = parent_rank[0].to(dev).long()  # [k]
        own = self._eye.get(k)
        if own is None:
            own = self._eye[k] = torch.eye(k, dtype=torch.bool, device=dev)
        tree_mask = torch.cat((self._tree_mask[0].index_select(0, rank), own), 1).unsqueeze(0)
        positions = torch.full((1, k), m + level - 1, dtype=torch.long, device=dev)
        h = self._frontier_h[0].index_select(0, rank).unsqueeze(0)  # [1, k, H]
        one = self.head.level_one_call(h, tokens.to(dev).long(), positions, self.pool, s, m + S,
                                       m, tree_mask.to(torch.uint8))  # fmt: skip
        if one is None:
            return None
        self._tree_mask, self._frontier_h, self._level = tree_mask, one[0], level
        return one[1]

    def _expand_in_pool(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                        tree_mask: torch.Tensor, S: int):  # fmt: skip
        """A level on the in-pool path: its k nodes' K/V into rows m_b + S .. m_b + S + k - 1
        of each slot (after the S rows of the earlier levels), attended where they lie. Returns
        h2. (One sequence's level reaches here only where its one C++ call does not apply:
        _expand_one tried it first.)"""
        B, k = tokens.shape
        dev, m = self.head.device, self._m_list
        if B == 1:
            s, r0 = self.slots[0], m[0] + S
            prefix_lens = kv_slots = None
            pool_k, pool_v = self.pool.k[0, s : s + 1], self.pool.v[0, s : s + 1]
            write = (slice(None), slice(r0, r0 + k))
        else:
            slots_i32, m_i32 = self._pool_args
            rows = self._m + S + torch.arange(k, dtype=torch.long, device=dev).view(1, k)
            write = (slots_i32.long().view(B, 1), rows)
            pool_k, pool_v, prefix_lens, kv_slots = self.pool.k[0], self.pool.v[0], m_i32, slots_i32
        h2 = self.head.layer_in_pool(
            h, tokens, positions, pool_k, pool_v, write, tree_mask.to(torch.uint8), max(m),
            prefix_lens, kv_slots,
        )  # fmt: skip
        return h2

    def _check_expand(self, level: int, parent_rank: torch.Tensor, tokens: torch.Tensor) -> None:
        if level != self._level + 1 or self._level < 0:
            raise ValueError(
                f"expand(level={level}) after level {self._level}: call root_logits() and then "
                "levels 1, 2, ... in order"
            )
        B = len(self.slots)
        if tokens.dim() != 2 or tokens.shape[0] != B or parent_rank.shape != tokens.shape:
            raise ValueError(
                f"parent_rank and tokens must both be [B={B}, topk], got "
                f"{list(parent_rank.shape)} and {list(tokens.shape)}"
            )
        # parent_rank's values are not checked here: that would read the device at every level.
        # draft_tree's come from select_expand (in range even for NaN scores); a rank outside
        # the nodes expanded at level - 1 fails the gather or index_select in expand ("index
        # ... is out of bounds" or "INDICES element is out of DATA bounds" on the CPU, a
        # device-side assert on a GPU).

    def commit(
        self,
        tree: kernels.Tree,
        verdict: kernels.Verdict,
        outcome: Outcome,
        features: torch.Tensor | None,
    ) -> None:
        """Queue each sequence's new pairs: the features of its root and accepted nodes, with
        the accepted tokens after the root then its bonus token (lengths from ``outcome``)."""
        if features is None:
            raise ValueError(
                "the EAGLE-3 drafter needs the target's features at the tree nodes; run the "
                f"target with feature_layers={self.head.feature_layers}"
            )
        self._level = -1
        B, N, F_in = features.shape
        bonus = verdict.bonus_token
        if N == 1 and B == 1 and bonus.device == features.device:
            # One sequence's plain step: its pair as the step made it, [1, 1, F] and [1] (any
            # int dtype), shaped and cast when it runs (take_waiting): a plain step's hot path,
            # no tensor made (so no torch.no_grad either: ~15 Python calls of a ~300-call step)
            slot = self.slots[0]
            if self.pool.lengths[slot] + self._pending_rows[slot] >= self.max_len:
                self._queue(slot, features[0], bonus)  # raises: the slot is full
            self._pending[slot].append((features, bonus))
            self._pending_rows[slot] += 1
            return
        self._commit_paths(tree, verdict, outcome, features)

    @torch.no_grad()
    def _commit_paths(self, tree: kernels.Tree, verdict: kernels.Verdict, outcome: Outcome,
                      features: torch.Tensor) -> None:  # fmt: skip
        """commit for a batch's plain step or any tree step: each path's pairs gathered."""
        B, N, F_in = features.shape
        bonus = verdict.bonus_token
        dev = features.device
        bonus = bonus.to(dev).long().view(B, 1)
        if N == 1:  # a plain step: each root's pair, nothing to gather (the bonus token from
            # the device: a step uploads nothing, tests/test_host_reads.py), _queue's work inline
            # (a step's hot path)
            for b, slot in enumerate(self.slots):
                if self.pool.lengths[slot] + self._pending_rows[slot] >= self.max_len:
                    self._queue(slot, features[b], bonus[b])  # raises: the slot is full
                self._pending[slot].append((features[b], bonus[b]))
                self._pending_rows[slot] += 1
            return
        lens = outcome.accept_len
        if B == 1:  # one sequence: its path, no padding
            path = verdict.accept_path[0, : lens[0]].long().to(dev)  # root first
            accepted = tree.tokens[0].to(dev).long()[path[1:]]
            self._queue(self.slots[0], features[0, path], torch.cat((accepted, bonus[0])))
            return
        n = max(lens)
        path = verdict.accept_path[:, :n].long().clamp(min=0).to(dev)  # [B, n] root first
        feats = features.gather(1, path.unsqueeze(2).expand(B, n, F_in))
        following = tree.tokens.to(dev).long().gather(1, path)  # token of node path[i]
        nxt = torch.cat((following[:, 1:], following[:, :1]), 1)  # token after pair i
        last = (verdict.accept_len.to(dev).long() - 1).view(B, 1)
        nxt = nxt.scatter(1, last, bonus)
        for b, slot in enumerate(self.slots):
            self._queue(slot, feats[b, : lens[b]], nxt[b, : lens[b]])
