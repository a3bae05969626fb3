// The extension module's functions (engine/cpu_kernels.py).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over the paged KV cache, read in place (CPU)");
  m.def("q8_0_linear", &q8_0_linear,
        "x @ W.T for W as int8 codes with a float scale per 32 inputs (GGUF Q8_0) (CPU)");
  m.def("q4_1_linear", &q4_1_linear,
        "x @ W.T for W as 4-bit codes with a float scale and min per 32 inputs (GGUF Q4_1) (CPU)");
}
