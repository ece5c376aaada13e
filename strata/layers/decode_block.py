"""A decode step's attention block and MLP block of a declared pre-norm decoder layer on CPU, each as one C call
(strata/kernels/cpu/csrc/decode_layer.c), which runs the same kernels the modules would call one by one: at a few
tokens a layer's dozen Python-level calls cost more than its arithmetic (about 0.35 ms a layer on a 2-core CPU).

The layer is read from its declaration (`DecoderLayerSpec`, strata/layers/decoder_layer.py: norms and where they sit,
projections with their biases, q/k norms, rotary with its rotated dimensions, the attention with its window, soft cap
and sinks, output scale, the MLP's activation), the one the torch forward interprets; nothing here knows an
architecture. `FusedDecodeLayer.serves` says whether a step can take it: float32 activations on CPU, a decode-only
step of the plain-torch attention path, few enough tokens for every linear's small-batch kernel, and weights those
kernels read (oneDNN-packed or plain float, int4 / int8 / FP8 weight-only, ggml blocks). A feed-forward block other
than a gated MLP (routed experts) runs as modules after the attention block's call; anything else keeps the modules'
path.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from strata.kernels.cpu import cpu_kernels_apply, crossovers, decode_layer
from strata.kernels.cpu import matmul as cpu_matmul
from strata.kernels.cpu.abi import AttentionBlock, Linear, MlpBlock
from strata.layers.attention import Attention, AttentionMetadata
from strata.layers.decoder_layer import DecoderLayerSpec, run_feed_forward
from strata.layers.linear import PackableLinear, small_batch_rows
from strata.layers.norm import GemmaRMSNorm, RMSNorm
from strata.layers.quantization.gguf_method import GGUFMethod

# KV caches the C attention reads from float32 rows: float32, or bfloat16 (--kv-cache-dtype), written rounded.
_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _blocks_linear(method: GGUFMethod, bias: torch.Tensor | None, keep: list) -> Linear:
    """A layer kept in ggml blocks: one weight, or pieces of several types whose outputs lie side by side."""
    int8 = method.activations == "int8"  # x rounded to 8 bits: the small-batch kernels' int8 kinds, at any rows
    pieces = [Linear(n=w.rows, k=method.k, weight=w.data.data_ptr(), row_bytes=w.data.stride(0),
                      kind=w.kernel_kind(method.activations),
                      gemm_rows=0 if int8 else _gemm_rows(method.small_rows[w.ggml_type]))
              for w in method._ready()]
    keep.extend(w.data for w in method._ready())
    if len(pieces) == 1:
        pieces[0].bias = _ptr(bias)
        return pieces[0]
    array = (Linear * len(pieces))(*pieces)
    keep.append(array)
    return Linear(n=method.n, k=method.k, bias=_ptr(bias), n_pieces=len(pieces),
                   pieces=ctypes.cast(array, ctypes.POINTER(Linear)))


def _gemm_rows(small_rows: int) -> int:
    """The rows from which a narrow weight's products in the C step take the GEMM (0: never, at the rows a step
    serves), past the crossover strata.kernels.cpu.crossovers measured."""
    return small_rows + 1 if small_rows < crossovers.SMALL_BATCH_WEIGHT_ONLY else 0


def describe_linear(layer: PackableLinear, bias: torch.Tensor | None, keep: list) -> tuple[Linear, int] | None:
    """The kernel's view of a linear layer and the most rows it serves (as `linear` and `weight_only_linear`
    choose kernels), or None when its weights need another path (activation-ordered or activation-quantized
    schemes, weights no small-batch kernel reads). Tensors the description points into are appended to `keep`."""
    if bias is not None:
        if bias.dtype != torch.float32:
            return None
        bias = bias.contiguous()
        keep.append(bias)
    if isinstance(layer.quant, GGUFMethod):
        if layer.quant.weights is None:
            return None
        return _blocks_linear(layer.quant, bias, keep), crossovers.SMALL_BATCH_GGUF
    if layer.quant is not None:
        method, w = layer.quant, getattr(layer.quant, "weight", None)
        if w is None or method.perm is not None or method.scheme.dynamic_activations:
            return None  # not finished yet, activation order (a gather per call), activations quantized per call
        keep.extend(t for t in (w.packed, w.scales, w.zeros) if t is not None)
        return Linear(blocked=0, n=w.out_features, k=w.in_features, weight=w.packed.data_ptr(), bias=_ptr(bias),
                       row_bytes=w.packed.stride(0), kind=w.kernel_kind, groups=w.scales.shape[1],
                       group_size=w.effective_group_size, scales=w.scales.data_ptr(), zeros=_ptr(w.zeros),
                       gemm_rows=_gemm_rows(method.small_rows)), crossovers.SMALL_BATCH_WEIGHT_ONLY
    weight = layer.weight
    if weight.is_mkldnn:
        layout = getattr(weight, "blocked_layout", None)
        if layout is None:
            return None
        keep.append(weight)
        return Linear(blocked=1, n=weight.out_features, k=weight.shape[1], weight=weight.buffer_address,
                       bias=_ptr(bias), bf16=int(weight.dtype == torch.bfloat16), block=layout.block,
                       k_pad=layout.k_pad), crossovers.SMALL_BATCH_DENSE
    kind = cpu_matmul.dense_kind(weight)
    if kind is None:
        return None
    keep.append(weight)
    return Linear(blocked=0, n=weight.shape[0], k=weight.shape[1], weight=weight.data_ptr(), bias=_ptr(bias),
                   row_bytes=weight.stride(0) * weight.element_size(), kind=kind), small_batch_rows(weight)


def is_decode_step(meta: object, rows: int) -> bool:
    """A step of `rows` decodes and no prefill, on the plain-torch attention path."""
    return isinstance(meta, AttentionMetadata) and meta.kernels == "torch" and not meta.prefills \
        and meta.num_decodes == rows and meta.slot_mapping.dtype == torch.int64 \
        and cpu_kernels_apply(meta.slot_mapping)


def norm_kernel_weight(n: RMSNorm) -> torch.Tensor:
    """The float32 weight the C norm multiplies by: the norm's own, or Gemma's 1 + w (made here, once per
    description: in float32, as GemmaRMSNorm adds it)."""
    return (1.0 + n.weight.float()) if isinstance(n, GemmaRMSNorm) else n.weight


def _kernel_weight(n: RMSNorm | None, keep: list) -> int | None:
    """The address of `norm_kernel_weight(n)`, None for no norm; keeps what it points to."""
    if n is None:
        return None
    weight = norm_kernel_weight(n)
    keep.append(weight)
    return weight.data_ptr()


def kernel_norms(*norms: nn.Module | None) -> bool:
    """Norms the C kernel computes as their modules do: float32 weights of an RMSNorm or a GemmaRMSNorm (exactly those
    classes: a subclass may compute otherwise)."""
    return all(n is None or (type(n) in (RMSNorm, GemmaRMSNorm) and n.weight.dtype == torch.float32) for n in norms)


class Plan:
    """A layer's two blocks, described once (after loading and packing: the weights no longer move); `mlp` None
    when its feed-forward block runs as modules; `adapters`: whether the C calls add the LoRA deltas of every
    projection with adapter slots (False: steps with adapter rows need the modules)."""

    def __init__(self, attention: AttentionBlock, mlp: MlpBlock | None, max_rows: int, attn: Attention,
                 keep: list, adapters: bool = True) -> None:
        self.attention, self.mlp, self.max_rows, self.keep = attention, mlp, max_rows, keep
        self.attn, self.k_cache, self.adapters = attn, attn.k_cache, adapters

    @property
    def current(self) -> bool:
        """Whether the caches it points into are still the layer's."""
        return self.attn.k_cache is self.k_cache

    def scratch_floats(self, tokens: int) -> int:
        a, m = self.attention, self.mlp
        q_width = a.num_heads * a.head_dim
        attention = a.hidden + (q_width + 2 * a.num_kv_heads * a.head_dim) + 2 * q_width
        mlp = 0 if m is None else m.hidden + 3 * m.intermediate
        return tokens * max(attention, mlp)


# The gated activations the C MLP block computes, by their declared names: its `gelu` flag.
_KERNEL_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def describe(spec: DecoderLayerSpec, ranges: int, rope: int = 0) -> Plan | None:
    """The layer's blocks as the C calls read them (`ranges`, `rope`: the indices of its attention's key ranges and
    of its rotary's tables in the step), or None when one of its parts needs the modules' path. The MLP block is
    None (its feed-forward block runs as modules) unless the declaration's feed-forward is a gated MLP of an
    activation the kernel computes."""
    attn, out_norms = spec.attn, (spec.attention_out_norm, spec.feed_forward_out_norm)
    if decode_layer.library() is None or decode_layer.kernels() is None or spec.rotary.interleaved \
            or attn.k_cache.dtype not in _CACHE_DTYPES \
            or attn.v_cache.dtype != attn.k_cache.dtype \
            or not kernel_norms(spec.input_norm, spec.feed_forward_norm, spec.q_norm, spec.k_norm, *out_norms):
        return None
    if spec.o_proj.pc.tp_size > 1 and any(out_norms):  # a norm of a block's output must follow its all-reduce
        return None
    if attn.sinks is not None and attn.sinks.dtype != torch.float32:
        return None
    mlp = spec.mlp if spec.mlp is not None and spec.mlp.activation in _KERNEL_ACTIVATIONS else None
    keep: list = [] if attn.sinks is None else [attn.sinks]
    first_rank = spec.o_proj.pc.tp_rank == 0
    linears = [describe_linear(spec.qkv_proj, spec.qkv_proj.bias, keep),
               describe_linear(spec.o_proj, spec.o_proj.bias if first_rank else None, keep)]
    if mlp is not None:
        linears += [describe_linear(mlp.gate_up_proj, mlp.gate_up_proj.bias, keep),
                    describe_linear(mlp.down_proj, mlp.down_proj.bias if first_rank else None, keep)]
    if any(d is None for d in linears):
        return None
    projections = [spec.qkv_proj, spec.o_proj] + ([mlp.gate_up_proj, mlp.down_proj] if mlp is not None else [])
    adapters = _attach_lora([d[0] for d in linears], projections, keep)
    max_rows = min(rows for _, rows in linears)
    hidden = spec.input_norm.weight.shape[0]
    attention_out, mlp_out = out_norms
    attention = AttentionBlock(
        norm_weight=_kernel_weight(spec.input_norm, keep), eps=spec.input_norm.eps, hidden=hidden,
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        block_size=attn.k_cache.shape[1], scale=attn.scale, qkv=linears[0][0], o=linears[1][0],
        k_cache=attn.k_cache.data_ptr(), v_cache=attn.v_cache.data_ptr(), q_norm=_kernel_weight(spec.q_norm, keep),
        k_norm=_kernel_weight(spec.k_norm, keep), qk_eps=spec.q_norm.eps if spec.q_norm else 0.0,
        rotary_dim=spec.rotary.rotary_dim, ranges=ranges, out_scale=spec.output_scale, softcap=attn.softcap or 0.0,
        sinks=_ptr(attn.sinks), out_norm=_kernel_weight(attention_out, keep),
        out_eps=attention_out.eps if attention_out else 0.0, rope=rope,
        kv_bf16=int(attn.k_cache.dtype == torch.bfloat16))
    keep.extend((attn.k_cache, attn.v_cache))
    mlp_block = None
    if mlp is not None:
        gate_up, down = linears[2][0], linears[3][0]
        norm = spec.feed_forward_norm
        mlp_block = MlpBlock(norm_weight=_kernel_weight(norm, keep), eps=norm.eps, hidden=hidden,
                             intermediate=gate_up.n // 2, gate_up=gate_up, down=down, out_scale=spec.output_scale,
                             gelu=_KERNEL_ACTIVATIONS[mlp.activation], out_norm=_kernel_weight(mlp_out, keep),
                             out_eps=mlp_out.eps if mlp_out else 0.0)
    return Plan(attention, mlp_block, max_rows, attn, keep, adapters)


def _attach_lora(linears: list[Linear], layers: list[PackableLinear], keep: list) -> bool:
    """Point each description at its layer's LoRA slots; False when a layer's slots are ones the C kernel cannot
    read (then a step with adapter rows keeps the modules)."""
    ready = True
    for linear, layer in zip(linears, layers, strict=True):
        if layer.lora is None:
            continue
        view = layer.lora.kernel_view()
        if view is None:
            ready = False
            continue
        keep += [view, layer.lora]
        linear.lora = ctypes.addressof(view)
    return ready


class FusedDecodeLayer:
    """The one-call-per-block decode path of a layer declared by `spec`, computing what `run_decoder_layer` computes.
    `windows` is its stack's list of the attention kinds (window, chunk) a step describes key ranges for, `rotaries`
    the list of rotary embeddings a step gives cos and sin tables of."""

    def __init__(self, spec: DecoderLayerSpec, windows: list, rotaries: list) -> None:
        self.spec, self.windows = spec, windows
        key = (spec.attn.sliding_window, spec.attn.chunk_size)
        if key not in windows:
            windows.append(key)
        self.ranges = windows.index(key)
        if not any(r is spec.rotary for r in rotaries):
            rotaries.append(spec.rotary)
        self.rope = next(i for i, r in enumerate(rotaries) if r is spec.rotary)
        self._plan: Plan | None | bool = False  # False: not described yet

    def serves(self, x: torch.Tensor, meta: object) -> bool:
        if not cpu_kernels_apply(x) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            return False
        return self.serves_rows(x.shape[0], meta)

    def serves_rows(self, rows: int, meta: object) -> bool:
        """Whether a decode step of `rows` float32 CPU rows can take it (described on first use)."""
        if not is_decode_step(meta, rows) or self.spec.attn.k_cache is None:
            return False
        if self._plan is False or (self._plan is not None and not self._plan.current):
            self._plan = describe(self.spec, self.ranges, self.rope)  # the first decode, or a cache bound anew
        return self._plan is not None and rows <= self._plan.max_rows

    @property
    def plan(self) -> Plan | None:
        return self._plan or None

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                 meta: AttentionMetadata, step: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual) of the layer; `step`: the step's (description, scratch) from `step_for`."""
        plan, spec = self._plan, self.spec
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        out = torch.empty_like(x)
        lib, kernels = decode_layer.library(), decode_layer.kernels()
        status = lib.attention_block(kernels, ctypes.byref(plan.attention), step[0], x.data_ptr(),
                                     residual.data_ptr(), int(first), step[1].data_ptr(), out.data_ptr())
        if status:
            raise MemoryError("decode attention block could not allocate its scratch memory")
        if spec.o_proj.reduce_results:
            out = spec.o_proj.pc.all_reduce(out)
        if plan.mlp is None:  # another feed-forward block (routed experts): its modules
            normed, residual = spec.feed_forward_norm(out, residual)
            return run_feed_forward(spec, normed), residual
        mlp_out = torch.empty_like(x)
        status = lib.mlp_block(kernels, ctypes.byref(plan.mlp), step[0], out.data_ptr(), residual.data_ptr(),
                               step[1].data_ptr(), mlp_out.data_ptr())
        if status:
            raise MemoryError("decode MLP block could not allocate its scratch memory")
        down = spec.feed_forward.down_proj
        if down.reduce_results:
            mlp_out = down.pc.all_reduce(mlp_out)
        return mlp_out, residual
