// Batch-invariant CPU kernels for a forward over GGUF weights kept in their quantized blocks.
//
// Every output of every function here is computed by one fixed sequence of fp32 operations that
// depends only on that output's own inputs: never on how many rows the call has, which other rows
// are in it, or how many threads run it. Row i of an n-row call therefore has the bits of a
// one-row call, so a verify forward over k+1 tokens equals k+1 one-token forwards bit for bit, and
// greedy speculative decoding equals plain greedy decoding by construction.
//
// How: each output is reduced by one thread (work is split over outputs, never inside a sum); a
// sum runs over 16-lane vectors in a fixed order with one final lane reduction; multiply-adds are
// explicit (the file is built with -ffp-contract=off, so the compiler never fuses differently for
// different row counts); exp is our own polynomial, the same code for every call.
//
// The weights: a matrix is (rows, row_bytes) uint8, each row its blocks as ggml lays them out
// (ggml-common.h: block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0, block_q4_K,
// block_q6_K) or plain fp32. Two product paths: fp32 activations (a row is dequantized in
// registers exactly as ggml dequantizes it, and the product is the fp32 dot product of the input
// with those weights), and, on CPUs with AVX2 or AVX512-VNNI, int8 activations (each input row rounded
// to int8 per block, integer dot products with the weights' integers, as llama.cpp multiplies).
// Both are batch-invariant.


#include <sys/mman.h>
#include <unistd.h>

#include "quant/head.h"
#include "quant/layers.h"
#include "quant/peak.h"
#include "quant/screen.h"


// The long-running functions release the GIL (as torch's own ops do), so that a server's other
// threads (its HTTP event loop) run while a forward computes; they touch no Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, "x W^T (+ b) over GGML-quantized weight parts, batch-invariant",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("parts"), py::arg("types"),
        py::arg("bias") = py::none(), py::arg("int8") = false);
#if defined(SPECDEC_INT8)
  m.def("repack", &repack, "(rows regrouped sixteen at a time for the int8 path, their type); None for other types",
        py::arg("rows"), py::arg("type"), py::arg("K"));
  m.def("q8_screen", &q8_screen, "a Q8_0 output layer's 4-bit screen (regrouped Q4_0) and its bound factor",
        py::call_guard<py::gil_scoped_release>(), py::arg("rows"), py::arg("K"));
  m.def("screened_logits", &screened_logits, "logits whose argmax is a Q8_0 output layer's, from its screen",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("screen"), py::arg("rows"), py::arg("c"));
#else
  m.def("repack", [](torch::Tensor, int64_t, int64_t) { return py::none(); },
        "None: this build has no int8 kernels, its rows go as they are", py::arg("rows"), py::arg("type"), py::arg("K"));
  m.def("q8_screen", [](torch::Tensor, int64_t) { return py::make_tuple(py::none(), 0.0); },
        "(None, 0.0): the screen multiplies with int8 activations, which this build has not", py::arg("rows"),
        py::arg("K"));
#endif
  m.def("release", [](torch::Tensor t) {
        // Drops this process's mapping of the whole pages inside a memory-mapped tensor (they stay in the
        // page cache and fault back in if read again): resident memory after the tensor was repacked.
        const uintptr_t page = sysconf(_SC_PAGESIZE), start = reinterpret_cast<uintptr_t>(t.data_ptr());
        const uintptr_t lo = (start + page - 1) / page * page, hi = (start + t.nbytes()) / page * page;
        if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
      }, "drop the resident pages of a memory-mapped tensor (never call it on other memory)");
  m.def("peak", &peak, "multiply-adds per second of the CPU's int8 (VNNI) or fp32 product instruction, measured",
        py::call_guard<py::gil_scoped_release>(), py::arg("kind"), py::arg("iterations") = 2000000);
  m.def("int8_available", []() { return HAS_Q8; }, "whether this build multiplies with int8 activations (AVX2 or AVX512-VNNI)");
  m.def("int8_kernels", &int8_kernels, "which int8 kernels this build has: 'vnni', 'avx2' or '' (none)");
#if defined(SPECDEC_INT8)
  static_assert(X16_TILE == TILE, "row_tile: one tile height for every product path");
#endif
  m.def("row_tile", []() { return TILE; }, "input rows per pass over the weights in every product kernel");
#if defined(SPECDEC_VNNI)
  m.def("amx_available", &amx_ready, "whether the int8 products may use AMX tiles here (CPU and Linux both allow it)");
  m.def("amx_on", &amx_on, "whether the int8 products of amx_rows() or more rows use AMX tiles now");
  m.def("amx_rows", []() { return AMX_ROWS; }, "input rows of a tile: products of fewer rows keep VNNI");
  m.def("amx_takes", [](int64_t type) { return amx_takes(type); }, "whether the tiles take a GGML type id's products",
        py::arg("type"));
  m.def("use_amx", &use_amx, "switch the AMX tiles on (where available) or off; returns whether they were on",
        py::arg("on"));
#else
  m.def("amx_available", []() { return false; }, "whether the int8 products may use AMX tiles here");
  m.def("amx_on", []() { return false; }, "whether the int8 products use AMX tiles now");
  m.def("amx_rows", []() { return 16; }, "input rows of a tile: products of fewer rows keep VNNI");
  m.def("amx_takes", [](int64_t) { return false; }, "no AMX in this build", py::arg("type"));
  m.def("use_amx", [](bool) { return false; }, "no AMX in this build", py::arg("on"));
#endif
  m.def("dequantize_rows", &dequantize_rows, "rows of a GGML-quantized matrix as fp32",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm per row");
  m.def("swiglu", &swiglu, "silu(gate) * up");
  m.def("geglu", &geglu, "gelu_tanh(gate) * up");
  m.def("rope_table", &rope_table, "cos and sin of the rotary angles at positions");
  m.def("rope", &rope, "rotary embedding in place, rotate-half layout");
  m.def("attention", &attention, "causal or masked attention over a KV cache, one task per position and head",
        py::call_guard<py::gil_scoped_release>());
  py::class_<Layer, std::shared_ptr<Layer>>(m, "Layer", "the weights of one decoder layer and how its architecture runs it")
      .def(py::init([](torch::Tensor norm_in, torch::Tensor norm_post, std::vector<torch::Tensor> qkv,
                       std::vector<int64_t> qkv_types, c10::optional<torch::Tensor> qkv_bias,
                       std::vector<torch::Tensor> o, std::vector<int64_t> o_types, std::vector<torch::Tensor> gate_up,
                       std::vector<int64_t> gate_up_types, std::vector<torch::Tensor> down,
                       std::vector<int64_t> down_types, torch::Tensor q_norm, torch::Tensor k_norm,
                       torch::Tensor attn_out_norm, torch::Tensor ffn_out_norm, int64_t rope, bool window, bool gelu,
                       double scale, double residual) {
             TORCH_CHECK(q_norm.numel() == 0 || k_norm.numel() > 0, "quant.Layer: a q norm needs a k norm");
             return std::make_shared<Layer>(Layer{norm_in, norm_post, qkv, o, gate_up, down, qkv_types, o_types,
                                                  gate_up_types, down_types, qkv_bias, q_norm, k_norm, attn_out_norm,
                                                  ffn_out_norm, rope, window, gelu, scale, residual});
           }),
           py::arg("norm_in"), py::arg("norm_post"), py::arg("qkv"), py::arg("qkv_types"), py::arg("qkv_bias"),
           py::arg("o"), py::arg("o_types"), py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"),
           py::arg("down_types"), py::arg("q_norm") = torch::empty({0}), py::arg("k_norm") = torch::empty({0}),
           py::arg("attn_out_norm") = torch::empty({0}), py::arg("ffn_out_norm") = torch::empty({0}),
           py::arg("rope") = 0, py::arg("window") = false, py::arg("gelu") = false, py::arg("scale") = 0.0,
           py::arg("residual") = 1.0);
  m.def("layers", &layers, "the decoder stack over one or more requests' new positions, h updated in place",
        py::call_guard<py::gil_scoped_release>(), py::arg("h"), py::arg("stack"), py::arg("keys"), py::arg("values"),
        py::arg("starts"), py::arg("counts"),
        py::arg("ropes"), py::arg("masks"), py::arg("windows"), py::arg("H"), py::arg("eps"), py::arg("int8"), py::arg("taps"),
        py::arg("features"));
  py::class_<Head, std::shared_ptr<Head>>(m, "Head", "an EAGLE draft head's weights: fc, one decoder layer, output rows")
      .def(py::init([](std::vector<torch::Tensor> fc, std::vector<int64_t> fc_types, std::shared_ptr<Layer> layer,
                       std::vector<torch::Tensor> out, std::vector<int64_t> out_types, torch::Tensor embed,
                       int64_t embed_type) {
             return std::make_shared<Head>(Head{fc, out, fc_types, out_types, layer, embed, embed_type});
           }),
           py::arg("fc"), py::arg("fc_types"), py::arg("layer"), py::arg("out"), py::arg("out_types"), py::arg("embed"),
           py::arg("embed_type"));
  m.def("head_step", &head_step, "one step of an EAGLE draft head: {predicted features (T, d), logits (1, N)}",
        py::call_guard<py::gil_scoped_release>(), py::arg("head"), py::arg("features"), py::arg("ids"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("inv_freq"), py::arg("H"), py::arg("eps"),
        py::arg("int8"));
}
