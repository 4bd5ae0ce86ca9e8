"""Prompts that look like what chat users ask, for a chat target's head data (issue 26).

A draft head learns the target's distribution where the engine will run it: after a chat
template, in the middle of an assistant's reply to a user. So the prompts cover what users ask
(the categories of MT-bench / Spec-Bench, none of their questions): writing, role-play,
reasoning, math word problems, coding, extraction / summaries / answers from a given passage,
translation, STEM, humanities and multi-turn follow-ups, plus self-instruct (the target writes
a user request itself from a seed topic; its reply then becomes the user turn of a new chat).

Sources, all made here, none downloaded and none from ``bench/data`` (held out):
- seed topics × task templates (lists below);
- math word problems with numbers drawn by the generator;
- passages: docstrings of the standard library's training split (rheo_engine.train.corpus);
- code spans of the same split (explain / review / test this code).

``sample_prompts(seed, n)`` is deterministic given (seed, n): a ``ChatPrompt`` holds the user
turns in order; the data generator answers turn 1, appends the reply, then asks turn 2, and so
on. A self-instruct prompt's one turn asks the target for a user request; the generator then
answers that request in a fresh chat.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from functools import lru_cache

from rheo_engine.train.corpus import load_corpus, read_text


@dataclass(frozen=True)
class ChatPrompt:
    category: str  # one of CATEGORIES
    turns: tuple[str, ...]  # user messages; turn k+1 is asked after the target answered turn k
    self_instruct: bool = False  # the reply to turns[0] is a user request to answer afresh


TOPICS = (
    "the ocean", "volcanoes", "honeybees", "the Roman Empire", "the French Revolution",
    "black holes", "climate change", "renewable energy", "electric cars", "coffee",
    "chess", "jazz music", "the Renaissance", "ancient Egypt", "the human heart",
    "vaccines", "sleep", "meditation", "running a marathon", "learning a language",
    "remote work", "job interviews", "saving money", "starting a small business", "gardening",
    "houseplants", "baking bread", "Italian cooking", "vegetarian diets", "dogs", "cats",
    "birds migrating", "the moon landing", "Mars exploration", "the internet", "smartphones",
    "social media", "privacy online", "artificial intelligence", "robots", "3D printing",
    "photography", "painting with watercolors", "writing a novel", "poetry", "Shakespeare",
    "Greek mythology", "the Silk Road", "the printing press", "the industrial revolution",
    "World War I", "the Cold War", "democracy", "human rights", "the United Nations",
    "the stock market", "inflation", "cryptocurrency", "public transport", "city planning",
    "rainforests", "deserts", "glaciers", "earthquakes", "hurricanes", "the water cycle",
    "plate tectonics", "DNA", "evolution", "the immune system", "antibiotics", "nutrition",
    "time management", "friendship", "moving to a new city", "travel in Japan", "camping",
    "hiking safety", "mountain climbing", "the Olympic Games", "football", "basketball",
    "video games", "board games", "movies", "classical music", "learning to play guitar",
    "architecture", "bridges", "the pyramids", "castles", "libraries", "museums",
    "recycling", "plastic pollution", "electricity", "magnets", "light and color", "sound",
    "gravity", "the solar system", "stars", "weather forecasts", "volunteering", "parenting",
    "teenagers and phones", "online learning", "exams", "public speaking", "negotiation",
    "leadership", "teamwork", "customer service", "a birthday party", "a wedding",
    "a rainy day", "a lost wallet", "a haunted house", "a dragon", "a time machine",
    "a small village", "a lighthouse keeper", "a detective", "a space station", "a bakery",
)

CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "summary",
    "passage_qa", "translation", "stem", "humanities", "multi_turn", "self_instruct",
)
# Shares of the categories in a sample (summing to 1): the chat mix of MT-bench-like use,
# with more math, code and passages, where a head has the most to gain.
WEIGHTS = (0.09, 0.06, 0.07, 0.1, 0.1, 0.06, 0.07, 0.07, 0.07, 0.07, 0.06, 0.09, 0.09)

WRITING = (
    "Write a short poem about {t}.", "Write a haiku about {t}.",
    "Write a short story about {t} in under 300 words.",
    "Write a blog post introduction about {t}.", "Write a persuasive paragraph about {t}.",
    "Write a formal email to my manager asking for a day off to learn about {t}.",
    "Write a product description for a book about {t}.",
    "Write a funny limerick about {t}.", "Write a speech for a school assembly about {t}.",
    "Write a diary entry of someone who just discovered {t}.",
    "Give me five catchy titles for an article about {t}.",
    "Write a letter to a friend describing {t}.",
)
ROLES = (
    "a pirate captain", "a medieval knight", "a travel guide", "a strict teacher",
    "a friendly robot", "a detective from the 1920s", "a personal fitness coach",
    "a chef on a cooking show", "a museum tour guide", "a wise old wizard",
    "a sports commentator", "a job interviewer", "a customer support agent", "a news reporter",
)
ROLEPLAY = (
    "Pretend you are {r}. Tell me about {t}.",
    "You are {r}. Stay in character and greet a visitor who wants to know about {t}.",
    "Act as {r} and give me advice about {t}.",
    "Imagine you are {r}. Describe your day, which somehow involves {t}.",
    "Role-play as {r}. I am a newcomer; explain {t} to me in your own style.",
)
REASONING = (
    "What are the pros and cons of {t}?", "Why do some people dislike {t}? Give three reasons.",
    "Compare {t} and {u}. Which matters more, and why?",
    "What would happen if {t} suddenly disappeared? Think step by step.",
    "Give a balanced argument for and against {t}.",
    "What are common misconceptions about {t}?",
    "Is it a good idea to spend a year studying {t}? Reason it out.",
)
STEM = (
    "How does {s} work? Explain.", "Explain {s} to a ten-year-old.",
    "What is {s}? Give an example.", "What are the main ideas behind {s}?",
    "Describe an experiment that demonstrates {s}.",
)
STEM_TOPICS = (
    "photosynthesis", "the Pythagorean theorem", "Newton's laws of motion", "entropy",
    "natural selection", "the speed of light", "prime numbers", "probability", "derivatives",
    "integrals", "vectors", "matrices", "chemical bonds", "the periodic table", "acids and bases",
    "electric circuits", "radio waves", "nuclear fusion", "cell division", "protein synthesis",
    "the greenhouse effect", "binary numbers", "sorting algorithms", "recursion",
    "hash tables", "compound interest", "statistics and averages", "the theory of relativity",
    "quantum mechanics", "friction", "buoyancy", "the nitrogen cycle",
    "photosynthesis vs respiration",
)
HUMANITIES = (
    "Summarize the main causes of {h}.", "Why is {h} important today?",
    "Describe the legacy of {h}.", "What can we learn from {h}?",
    "Explain {h} in a few paragraphs.", "Who were the key figures of {h}?",
)
HUMANITIES_TOPICS = (
    "the fall of the Roman Empire", "the French Revolution", "the Enlightenment",
    "the Renaissance", "the Reformation", "the American civil rights movement",
    "Stoic philosophy", "Plato's Republic", "existentialism", "impressionist painting",
    "the Industrial Revolution", "the Meiji Restoration", "the Mongol Empire",
    "the invention of writing", "the Silk Road", "utilitarianism", "the Harlem Renaissance",
    "Greek tragedy", "the Cold War", "decolonization in Africa", "the printing press",
)
CODING = (
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "How would I write code that {c}? Use Python and explain it.",
    "Write a C function that {c}.", "Write a Python class with a method that {c}, and a test.",
    "What is the time complexity of a function that {c}? Show an implementation.",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "finds the largest element of a list", "merges two sorted lists", "removes duplicates "
    "from a list while keeping order", "computes the nth Fibonacci number",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
    "reads a CSV file and sums a column", "flattens a nested list", "finds the most common "
    "letter in a string", "validates an email address", "computes the factorial of n",
    "sorts a list of dictionaries by a key", "returns the intersection of two lists",
    "parses a date string", "implements binary search", "counts vowels in a sentence",
    "rotates a matrix by 90 degrees", "groups words that are anagrams",
    "converts a Roman numeral to an integer", "computes the GCD of two numbers",
)
CODE_SPAN = (
    "Explain what this code does:\n\n```python\n{code}\n```",
    "Review this code and suggest improvements:\n\n```python\n{code}\n```",
    "Write a unit test for this code:\n\n```python\n{code}\n```",
    "Add comments to this code:\n\n```python\n{code}\n```",
)
EXTRACTION = (
    "List every function or parameter name mentioned in this passage:\n\n{p}",
    "Extract the key facts from this passage as bullet points:\n\n{p}",
    "From the passage below, extract what the thing described returns, if anything.\n\n{p}",
    'Turn this passage into a JSON object with fields "name", "purpose" and "details":\n\n{p}',
)
SUMMARY = (
    "Summarize this passage in two sentences:\n\n{p}",
    "Give a one-line summary of the following text:\n\n{p}",
    "Summarize the following for a beginner:\n\n{p}",
    "Write a TL;DR of this:\n\n{p}",
)
PASSAGE_QA = (
    "Read the passage and answer: what is it for?\n\n{p}",
    "{p}\n\nBased on the passage above, when would someone use this?",
    "Passage:\n{p}\n\nQuestion: what are the limitations mentioned in the passage?",
    "{p}\n\nExplain the passage above in simple words, then ask me one quiz question about it.",
)
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese")
TRANSLATION = (
    "Translate into {lang}: \"{s}\"", "How do you say \"{s}\" in {lang}?",
    "Translate this sentence to {lang} and explain the grammar: {s}",
    "Translate the following into {lang}, keeping the tone informal:\n{s}",
)
SUBJECTS = ("My sister", "The old man", "Our teacher", "The children", "A tourist", "My neighbor",
            "The doctor", "Everyone in the office")  # fmt: skip
ACTIONS = ("is reading a book about", "wants to learn more about", "talked for hours about",
           "is worried about", "wrote a letter about", "cannot stop thinking about")  # fmt: skip
WHENS = ("this morning", "every weekend", "last summer", "before dinner", "after the meeting",
         "since last year")  # fmt: skip
FOLLOW_UPS = (
    "Can you make it shorter?", "Now explain it as if I were five.", "Give me an example.",
    "Can you rewrite that in a more formal tone?", "What are the sources of error here?",
    "Summarize your answer in three bullet points.", "Why? Explain your reasoning.",
    "Now do the same for {u}.", "Turn that into a short quiz with answers.",
    "Translate your answer into French.", "What is the most important point you made?",
)
SELF_INSTRUCT = (
    "Write one question that a curious user might ask an AI assistant about {t}. Reply with "
    "the question only.",
    "Write a realistic request that someone could send to a chatbot about {t}, as the user "
    "would type it. Reply with the request only.",
    "Invent a task about {t} that a student might ask an assistant for help with. Write only "
    "the task.",
    "Write a tricky question about {t} that needs some reasoning to answer. Only the question.",
)


def math_problem(rng: random.Random) -> str:
    """An arithmetic word problem with drawn numbers (the target answers; no key is kept)."""
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    price = rng.choice((0.5, 1.25, 2, 3.5, 4, 7.5, 12))
    name = rng.choice(("Maya", "Tom", "Aisha", "Luis", "Chen", "Olga", "Sam", "Priya"))
    item = rng.choice(("apples", "pencils", "stickers", "books", "cookies", "marbles", "tickets"))
    forms = (
        f"{name} has {a} {item} and buys {b} more. Then {name} gives away {c}. How many {item} "
        f"does {name} have now?",
        f"Each of {c} boxes holds {a} {item}. {name} sells {b} {item}. How many are left?",
        f"{name} buys {a} {item} at ${price} each and pays with a "
        f"${(int(a * price) // 10 + 1) * 10}"
        f" bill. How much change does {name} get?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed? How far would it "
        f"go in {b} hours at that speed?",
        f"{name} saves ${a} a week. How many weeks until {name} can buy a bike that costs "
        f"${a * b + c}?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"{name} read {a} pages on Monday and {c} times as many on Tuesday. The book has "
        f"{a * (c + 1) + b} pages. How many pages are left?",
        f"A recipe needs {c} eggs for {b} people. How many eggs for {a} people? Round up.",
        f"The price of a jacket is ${a * 5}. It is discounted by {rng.choice((10, 15, 20, 25))}%. "
        f"What is the new price?",
        f"What is {a} * {b} + {c * 7}? Show your work.",
        f"{name} is {a} years old. {name}'s mother is {c} times {name}'s age minus {min(b, a)}. "
        f"How old is the mother?",
    )
    return rng.choice(forms)


def reasoning_puzzle(rng: random.Random) -> str:
    """A short ordering puzzle with drawn names."""
    names = rng.sample(("Ana", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus"), 3)
    trait = rng.choice((("taller", "tallest"), ("older", "oldest"), ("faster", "fastest")))
    return (f"{names[0]} is {trait[0]} than {names[1]}, and {names[1]} is {trait[0]} than "
            f"{names[2]}. Who is the {trait[1]}? Explain your reasoning.")  # fmt: skip


@lru_cache(maxsize=1)
def passages() -> tuple[str, ...]:
    """Docstrings of 200-1200 characters from the stdlib corpus's training split, in file order."""
    found = []
    for f in load_corpus().train:
        try:
            tree = ast.parse(read_text(f))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and 200 <= len(doc) <= 1200:
                    found.append(doc)
    return tuple(found)


@lru_cache(maxsize=1)
def code_spans() -> tuple[str, ...]:
    """Functions of 4-30 lines from the stdlib corpus's training split (source text)."""
    found = []
    for f in load_corpus().train:
        text = read_text(f)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if 4 <= n <= 30:
                    found.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    return tuple(found)


def translation_sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(TOPICS)} {rng.choice(WHENS)}."


def first_turn(category: str, rng: random.Random) -> str:
    """One user message of ``category`` (not multi_turn / self_instruct)."""
    t, u = rng.sample(TOPICS, 2)
    if category == "writing":
        return rng.choice(WRITING).format(t=t)
    if category == "roleplay":
        return rng.choice(ROLEPLAY).format(r=rng.choice(ROLES), t=t)
    if category == "reasoning":
        if rng.random() < 0.3:
            return reasoning_puzzle(rng)
        return rng.choice(REASONING).format(t=t, u=u)
    if category == "math":
        return math_problem(rng)
    if category == "coding":
        if rng.random() < 0.4:
            return rng.choice(CODE_SPAN).format(code=rng.choice(code_spans()))
        return rng.choice(CODING).format(c=rng.choice(CODE_TASKS))
    if category in ("extraction", "summary", "passage_qa"):
        table = {"extraction": EXTRACTION, "summary": SUMMARY, "passage_qa": PASSAGE_QA}
        return rng.choice(table[category]).format(p=rng.choice(passages()))
    if category == "translation":
        template = rng.choice(TRANSLATION)
        return template.format(lang=rng.choice(LANGUAGES), s=translation_sentence(rng))
    if category == "stem":
        return rng.choice(STEM).format(s=rng.choice(STEM_TOPICS))
    if category == "humanities":
        return rng.choice(HUMANITIES).format(h=rng.choice(HUMANITIES_TOPICS))
    raise ValueError(f"category {category!r} has no first-turn templates; one of {CATEGORIES}")


SINGLE = tuple(c for c in CATEGORIES if c not in ("multi_turn", "self_instruct"))


def sample_prompt(rng: random.Random) -> ChatPrompt:
    category = rng.choices(CATEGORIES, WEIGHTS)[0]
    if category == "multi_turn":
        first = first_turn(rng.choice(SINGLE), rng)
        follow = rng.choice(FOLLOW_UPS).format(u=rng.choice(TOPICS))
        return ChatPrompt(category, (first, follow))
    if category == "self_instruct":
        return ChatPrompt(category, (rng.choice(SELF_INSTRUCT).format(t=rng.choice(TOPICS)),), True)
    return ChatPrompt(category, (first_turn(category, rng),))


def sample_prompts(seed: int, n: int) -> list[ChatPrompt]:
    """n prompts, the same for the same (seed, n) on every machine and Python version with the
    same standard library (the passages and code spans come from it)."""
    rng = random.Random(f"rheo-chat-prompts:{seed}")
    return [sample_prompt(rng) for _ in range(n)]


def clean_request(reply: str) -> str | None:
    """A self-instruct reply as a user request: its first non-empty paragraph, quotes and
    "Question:" labels stripped; None when nothing usable (too short or long) remains."""
    text = reply.strip()
    para = next((p.strip() for p in text.split("\n\n") if p.strip()), "")
    for label in ("Question:", "Request:", "Task:", "User:"):
        if para.lower().startswith(label.lower()):
            para = para[len(label) :].strip()
    para = para.strip("\"'“” ")
    return para if 10 <= len(para) <= 600 else None
