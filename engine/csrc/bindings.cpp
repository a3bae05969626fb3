// The extension module's functions (engine/cpu_kernels.py).
#include "kernels.h"

namespace {
// Each kernel runs without the GIL, as torch's own operators do: a decode step spends most of
// its time in them, and meanwhile the worker's gRPC threads (streaming the last step's tokens,
// answering heartbeats and metrics) need the GIL, on another core.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, NoGil(),
        "Decode attention over the paged KV cache, read in place (CPU)");
  m.def("q8_0_linear", &q8_0_linear, NoGil(),
        "x @ W.T for W as int8 codes with a float scale per 32 inputs (GGUF Q8_0) (CPU)");
  m.def("q4_1_linear", &q4_1_linear, NoGil(),
        "x @ W.T for W as 4-bit codes with a float scale and min per 32 inputs (GGUF Q4_1) (CPU)");
  m.def("rms_norm", &rms_norm, NoGil(), "Hugging Face Llama's RMSNorm of each row (CPU, float32)");
  m.def("add_rms_norm_", &add_rms_norm_, NoGil(),
        "x += delta in place, then RMSNorm of each row of x (CPU, float32)");
  m.def("rope_store_kv_", &rope_store_kv_, NoGil(),
        "RoPE on q and k in place in qkv, then k and v stored in the paged cache (CPU, float32)");
  m.def("silu_mul", &silu_mul, NoGil(), "SiLU(gate) * up of each [gate | up] row (CPU, float32)");
}
