// The one pybind11 module, rheo_engine._C: one line per exported function, grouped by kernel.
// rheo_engine/kernels.py is the only Python file that imports it.
#include <torch/extension.h>

#include <string>

#include "bindings.h"
#include "rheo/common.h"

#if __has_include("rheo_build_info.h")
#include "rheo_build_info.h"  // setup.py writes it (build/generated): what this build holds
#endif

namespace {

std::string cpu_isa() { return rheo::cpu::isa_name(rheo::cpu::active_isa()); }

std::string set_cpu_isa(const std::string& level) {
  return rheo::cpu::isa_name(rheo::cpu::set_active_isa(rheo::cpu::parse_isa(level, "level")));
}

bool has_cuda() {
#ifdef RHEO_WITH_CUDA
  return true;
#else
  return false;
#endif
}

const char* build_info() {
#ifdef RHEO_BUILD_INFO
  return RHEO_BUILD_INFO;
#else
  return has_cuda() ? "cpu + cuda" : "cpu";
#endif
}

// Why the CUDA kernels were or were not built (setup.py's reason), "" when not recorded.
const char* cuda_build_note() {
#ifdef RHEO_CUDA_BUILD_NOTE
  return RHEO_CUDA_BUILD_NOTE;
#else
  return "";
#endif
}

// The torch version this extension was compiled against, "" when not recorded.
const char* built_with_torch() {
#ifdef RHEO_BUILT_WITH_TORCH
  return RHEO_BUILT_WITH_TORCH;
#else
  return "";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace b = rheo::bind;
  m.def("has_cuda", &has_cuda, "True when the CUDA kernels were compiled in.");
  m.def("build_info", &build_info, "What was built, e.g. 'cpu + cuda sm_90'.");
  m.def("cuda_build_note", &cuda_build_note, "Why the CUDA kernels were or were not built.");
  m.def("built_with_torch", &built_with_torch, "The torch version the build compiled against.");
  // CPU dispatch level, read here so that a bad RHEO_CPU_ISA fails the import and not a kernel
  rheo::cpu::active_isa();
  m.def("cpu_isa", &cpu_isa, "The CPU kernels' dispatch level: 'default', 'avx2' or 'avx512'.");
  m.def("set_cpu_isa", &set_cpu_isa, "Set that level, lowered to what the CPU runs (tests).");
  // the status word's bits (common.h StatusBit), so that Python reads them from one place
  m.attr("STATUS_NON_FINITE_DRAFT") = static_cast<int>(rheo::kStatusNonFiniteDraft);
  m.attr("STATUS_BAD_FORCED") = static_cast<int>(rheo::kStatusBadForced);
  m.attr("STATUS_NAN_SCORE") = static_cast<int>(rheo::kStatusNanScore);
  m.attr("STATUS_BAD_TREE") = static_cast<int>(rheo::kStatusBadTree);
  m.attr("STATUS_NON_FINITE_TARGET") = static_cast<int>(rheo::kStatusNonFiniteTarget);
  m.attr("STATUS_BAD_VERIFY_INPUT") = static_cast<int>(rheo::kStatusBadVerifyInput);
  m.attr("STATUS_BAD_CONTROLS") = static_cast<int>(rheo::kStatusBadControls);
  // fused layer operators
  m.def("add_rms_norm", &b::add_rms_norm, "RMSNorm (HF Llama) of x + delta; writes both.");
  m.def("rope_qk", &b::rope_qk, "RoPE (rotate_half) on the q and k heads of a fused qkv.");
  m.def("silu_mul", &b::silu_mul, "SiLU(gate) * up from a fused gate_up.");
  // module_local: tests load a second build of this module (the CUDA emulator's) beside it
  pybind11::class_<b::DecoderLayers>(m, "DecoderLayers", pybind11::module_local(),
                                     "A Llama target's decoder layers on the CPU in one call.")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                          std::vector<int64_t>, at::Tensor, double, int64_t, int64_t, int64_t>())
      .def("run", &b::DecoderLayers::run, "One sequence's forward through every layer.");
  pybind11::class_<b::DraftLevel>(m, "DraftLevel", pybind11::module_local(),
                                  "An EAGLE-3 head's draft level on the CPU in one call.")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                          std::vector<int64_t>, double, int64_t, int64_t, int64_t>())
      .def("run", &b::DraftLevel::run, "One sequence's level: h2 and the draft logits.",
           pybind11::arg("h"), pybind11::arg("e"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("slot"),
           pybind11::arg("row0"), pybind11::arg("prefix"), pybind11::arg("tree_mask"),
           pybind11::arg("logit_rows") = -1);
  // logit controls
  m.def("logit_controls", &b::logit_controls, "Penalties and bans of each node's row, in place.");
  // pool sampler
  m.def("pool_sampler", &b::pool_sampler, "K children, proxy log-probs, sampled slot, sparse q~.");
  // proxy rerank
  m.def("select_expand", &b::select_expand, "Indices of the topk candidates to expand, best first.");
  m.def("build_tree", &b::build_tree, "Global top-(N-1) with the tie rule; tree layout.");
  // quantized linear
  m.def("quantize_rows_q8", &b::quantize_rows_q8, "Rows of x as Q8 blocks of 32 (codes, scale, sum).");
  m.def("quant_linear", &b::quant_linear, "y = x W^T with W in packed Q8_0 / Q4_0 / Q4_1 blocks.");
  m.def("quant_gather_rows", &b::quant_gather_rows, "Rows of a packed W dequantized (embedding lookup).");
  m.def("quant_linear_amx", &b::quant_linear_amx, "What the AMX-INT8 path runs on: hardware, emulated, off.");
  m.def("set_quant_linear_amx", &b::set_quant_linear_amx, "Its mode: auto, off, emulate (tests).");
  m.def("quant_linear_amx_self_check", &b::quant_linear_amx_self_check, "Its logic on emulated tiles.");
  // skinny linear
  m.def("skinny_linear", &b::skinny_linear, "y = x W^T for a few rows of x (fp32 sums).");
  m.def("skinny_linear_bf16_dot", &b::skinny_linear_bf16_dot, "Whether bf16 runs on vdpbf16ps.");
  m.def("set_skinny_linear_bf16_dot", &b::set_skinny_linear_bf16_dot, "Allow it or not (tests).");
  // tree attention
  m.def("tree_attention", &b::tree_attention, "Attention of N tree nodes over prefix + tree (GQA), ragged / pooled.");
  m.def("tree_attention_exp_check", &b::tree_attention_exp_check, "Its vector exp against std::exp (tests).");
  // verification
  m.def("verification", &b::verification, "Accepted path and emitted token of each tree.");
  m.def("verification_law", &b::verification_law, "Exact law of the walk (CPU; tests).");
}
