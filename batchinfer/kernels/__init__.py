"""Triton kernels, each with a plain-PyTorch reference (reference.py) that defines its math.

Use `batchinfer.kernels.ops`, which runs the Triton kernel on CUDA and the reference elsewhere.
Modules: cache (KV write), decode_attention (paged flash-decoding), extend_attention (prefill
over the paged cache, and its tile map), rmsnorm, rotary, activation (SiLU-and-mul), bitmask
(grammar mask), sampling (fused Gumbel-max draw), fp8_quant (per-token FP8 quantisation of activations); kernels/README.md lists them all. Kernels never
import the attention, engine or model layers.
interpreter.py explains running them on CPU (Triton interpreter, a per-process choice);
`python -m batchinfer.kernels.compile_check` compiles them all for sm_90 without a GPU.
"""
