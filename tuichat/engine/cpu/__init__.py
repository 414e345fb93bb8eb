"""tuichat's CPU kernels: one shared library of C, built on the machine that runs it, and its Python side.

Why kernels of our own: a decode step is bound by reading the weights once, and for a few rows torch's CPU
kernels (bf16 gemv, oneDNN's brgemm) read them at well under the memory's bandwidth, where ours, prefetching
the next weight rows while the tiles multiply, come close to it; and the rest of a step through transformers'
modules is many small torch ops (the figures and the commands that re-measure them: docs/design/kernels.md).

What is where:
- build.py: the compiler, its flags (-march=native, or TUICHAT_CPU_ARCH), the build of every csrc/ file into
  one library and its trusted cache; `load()` gives the kernels or why there are none.
- native.py: the library's one declared ABI on the Python side (every export's ctypes signature, the structs
  decoder_step reads, checked against kernel_abi()), and NativeDecoder, which serves steps through decoder.c.
- csrc/: the C sources, one file per job; `kernels.h` declares every function one file defines for another or
  exports, and the vector helpers all share.
  - scratch.c: the intermediates' memory pool.
  - linear.c: the linear for any weight format (any_linear, scratch_linear) and kernel_isa.
  - linear.h: what the linears share: the register tile, the weight formats, each quantized path's entry.
  - linear_bf16.c: the bf16 linear on vector units, and cpu_linear (AMX where built, else this).
  - linear_quant.c: GGUF blocks in fp32 on any CPU, and the choice of path per format and shape.
  - pack.c: GGUF blocks into the layout each path reads, once at load.
  - decoder.c: a llama-family step's decoder layers, attention over the paged cache.
  - sampler.c: one sampled row's token.
  - arch/x86/: code for x86 instruction sets, each file compiled in every build and empty (or a stub that
    says "not here") where the build lacks its instructions: amx.c (the bf16 linear on AMX tiles),
    linear_int8.c (int8 dot products over pairs of blocks, AVX2 and up), linear_vnni512.c (int8 tiles of 16
    weight rows, AVX512-VNNI: every GGUF format, the K-quants' re-cut blocks included).
"""
