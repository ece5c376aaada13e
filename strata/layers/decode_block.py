"""A decode step's attention block and SwiGLU block of a pre-norm decoder layer on CPU, each as one C call
(strata/csrc/decode_layer.c), which runs the same kernels the modules would call one by one: at a few tokens a
layer's dozen Python-level calls cost more than its arithmetic (about 0.35 ms a layer on a 2-core CPU).

`FusedDecodeLayer.serves` says whether a step can take it: float32 activations on CPU, a decode-only step of the
plain-torch attention path, few enough tokens for every linear's small-batch kernel, and layers whose weights those
kernels read (oneDNN-packed or plain float, or int4 / int8 / FP8 weight-only). Anything else keeps the modules' path.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from strata import native
from strata.layers import activation, cpu_attention, norm, onednn_weights, rotary
from strata.layers.attention import AttentionMetadata
from strata.layers.linear import SMALL_BATCH_DENSE, PackableLinear, small_batch_rows
from strata.layers.norm import RMSNorm
from strata.layers.quantization import cpu_matmul
from strata.layers.quantization import weight_only as weight_only_module
from strata.native import PTR

I64 = ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [(name, PTR) for name in ("weight_only", "blocked", "rms_norm", "rope", "silu", "attention")]


class _Linear(ctypes.Structure):
    _fields_ = [("blocked", I64), ("n", I64), ("k", I64), ("weight", PTR), ("bias", PTR), ("bf16", I64),
                ("block", I64), ("k_pad", I64), ("row_bytes", I64), ("kind", I64), ("groups", I64),
                ("group_size", I64), ("scales", PTR), ("zeros", PTR)]


class _AttentionBlock(ctypes.Structure):
    _fields_ = [("norm_weight", PTR), ("eps", ctypes.c_float), ("hidden", I64), ("num_heads", I64),
                ("num_kv_heads", I64), ("head_dim", I64), ("block_size", I64), ("scale", ctypes.c_float),
                ("qkv", _Linear), ("o", _Linear), ("k_cache", PTR), ("v_cache", PTR)]


class _MlpBlock(ctypes.Structure):
    _fields_ = [("norm_weight", PTR), ("eps", ctypes.c_float), ("hidden", I64), ("intermediate", I64),
                ("gate_up", _Linear), ("down", _Linear)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", I64), ("max_blocks", I64), ("cos", PTR), ("sin", PTR), ("block_tables", PTR),
                ("first_keys", PTR), ("seq_lens", PTR), ("slots", PTR), ("threads", I64)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    blocks = [ctypes.POINTER(_Kernels), PTR, ctypes.POINTER(_Step), PTR, PTR]
    return native.bind("decode_layer", {
        "attention_block": (blocks + [ctypes.c_int, PTR, PTR], ctypes.c_int),
        "mlp_block": (blocks + [PTR, PTR], ctypes.c_int),
        "decode_layers": ([ctypes.POINTER(_Kernels), PTR, PTR, I64, ctypes.POINTER(_Step), PTR, PTR, ctypes.c_int,
                           PTR, PTR, PTR, PTR, ctypes.c_float], ctypes.c_int),
        "decode_forward": ([ctypes.POINTER(_Kernels), PTR, PTR, I64, ctypes.POINTER(_Step), PTR, PTR, PTR, PTR, PTR,
                            PTR], ctypes.c_int)})


@functools.cache
def _kernels() -> _Kernels | None:
    """The other libraries' entry points, or None when one of them cannot be built here."""
    sources = {"weight_only": (cpu_matmul._library, "weight_only_matmul"),
               "blocked": (onednn_weights._library, "blocked_matmul"), "rms_norm": (norm._library, "rms_norm"),
               "rope": (rotary._library, "rope_half_split"), "silu": (activation._library, "silu_and_mul"),
               "attention": (cpu_attention._library, "paged_decode_attention")}
    addresses = {}
    for field, (library, name) in sources.items():
        lib = library()
        if lib is None:
            return None
        addresses[field] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    return _Kernels(**addresses)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def describe_linear(layer: PackableLinear, bias: torch.Tensor | None, keep: list) -> tuple[_Linear, int] | None:
    """The kernel's view of a linear layer and the most rows it serves (as `linear` and `weight_only_linear`
    choose kernels), or None when its weights need another path (activation-ordered or activation-quantized
    schemes, weights no small-batch kernel reads). Tensors the description points into are appended to `keep`."""
    if bias is not None:
        if bias.dtype != torch.float32:
            return None
        bias = bias.contiguous()
        keep.append(bias)
    if layer.quant is not None:
        method, w = layer.quant, getattr(layer.quant, "weight", None)
        if w is None or method.perm is not None or method.scheme.dynamic_activations:
            return None  # not finished yet, activation order (a gather per call), activations quantized per call
        keep.extend(t for t in (w.packed, w.scales, w.zeros) if t is not None)
        return _Linear(blocked=0, n=w.out_features, k=w.in_features, weight=w.packed.data_ptr(), bias=_ptr(bias),
                       row_bytes=w.packed.stride(0), kind=w.kernel_kind, groups=w.scales.shape[1],
                       group_size=w.effective_group_size, scales=w.scales.data_ptr(),
                       zeros=_ptr(w.zeros)), weight_only_module.SMALL_BATCH
    weight = layer.weight
    if weight.is_mkldnn:
        layout = getattr(weight, "blocked_layout", None)
        if layout is None:
            return None
        keep.append(weight)
        return _Linear(blocked=1, n=weight.out_features, k=weight.shape[1], weight=weight.buffer_address,
                       bias=_ptr(bias), bf16=int(weight.dtype == torch.bfloat16), block=layout.block,
                       k_pad=layout.k_pad), SMALL_BATCH_DENSE
    kind = cpu_matmul.dense_kind(weight)
    if kind is None:
        return None
    keep.append(weight)
    return _Linear(blocked=0, n=weight.shape[0], k=weight.shape[1], weight=weight.data_ptr(), bias=_ptr(bias),
                   row_bytes=weight.stride(0) * weight.element_size(), kind=kind), small_batch_rows(weight)


def _is_decode_step(meta: object, rows: int) -> bool:
    """A step of `rows` decodes and no prefill, on the plain-torch attention path."""
    return isinstance(meta, AttentionMetadata) and meta.kernels == "torch" and not meta.prefills \
        and meta.num_decodes == rows and meta.slot_mapping.dtype == torch.int64 \
        and meta.slot_mapping.device.type == "cpu"


class _Plan:
    """The two blocks of one layer, described once (after loading and packing: the weights no longer move)."""

    def __init__(self, attention: _AttentionBlock, mlp: _MlpBlock, max_rows: int, attn: torch.nn.Module,
                 keep: list) -> None:
        self.attention, self.mlp, self.max_rows, self.keep = attention, mlp, max_rows, keep
        self.attn, self.k_cache = attn, attn.k_cache

    @property
    def current(self) -> bool:
        """Whether the caches it points into are still the layer's."""
        return self.attn.k_cache is self.k_cache


class FusedDecodeLayer:
    """The one-call-per-block decode path of a layer with `input_layernorm`, `self_attn` (qkv_proj, rotary, attn,
    o_proj) and a SwiGLU `mlp` (gate_up_proj, down_proj), computing what the modules compute."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self._plan: _Plan | None | bool = False  # False: not described yet

    def serves(self, x: torch.Tensor, meta: object) -> bool:
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            return False
        return self.serves_rows(x.shape[0], meta)

    def serves_rows(self, rows: int, meta: object) -> bool:
        """Whether a decode step of `rows` float32 CPU rows can take it (described on first use)."""
        if not _is_decode_step(meta, rows):
            return False
        k_cache = self.layer.self_attn.attn.k_cache
        if k_cache is None:
            return False
        if self._plan is False or (self._plan is not None and not self._plan.current):
            self._plan = self._describe()  # the first decode, or a cache bound anew
        return self._plan is not None and rows <= self._plan.max_rows

    def _describe(self) -> _Plan | None:
        layer = self.layer
        attn_module, mlp = layer.self_attn, layer.mlp
        attn, rope = attn_module.attn, attn_module.rotary
        if _library() is None or _kernels() is None or rope.interleaved or attn.k_cache.dtype != torch.float32:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.weight.dtype != torch.float32 for n in norms):
            return None
        keep: list = [n.weight for n in norms]
        o_bias = attn_module.o_proj.bias if attn_module.o_proj.pc.tp_rank == 0 else None
        down_bias = mlp.down_proj.bias if mlp.down_proj.pc.tp_rank == 0 else None
        linears = [describe_linear(attn_module.qkv_proj, attn_module.qkv_proj.bias, keep),
                   describe_linear(attn_module.o_proj, o_bias, keep),
                   describe_linear(mlp.gate_up_proj, mlp.gate_up_proj.bias, keep),
                   describe_linear(mlp.down_proj, down_bias, keep)]
        if any(d is None for d in linears):
            return None
        (qkv, r1), (o, r2), (gate_up, r3), (down, r4) = linears
        max_rows = min(r1, r2, r3, r4, norm.KERNEL_ROWS, rotary.KERNEL_TOKENS, activation.KERNEL_ROWS)
        hidden = norms[0].weight.shape[0]
        attention = _AttentionBlock(
            norm_weight=norms[0].weight.data_ptr(), eps=norms[0].eps, hidden=hidden, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, block_size=attn.k_cache.shape[1],
            scale=attn.scale, qkv=qkv, o=o, k_cache=attn.k_cache.data_ptr(), v_cache=attn.v_cache.data_ptr())
        keep.extend((attn.k_cache, attn.v_cache))
        block = _MlpBlock(norm_weight=norms[1].weight.data_ptr(), eps=norms[1].eps, hidden=hidden,
                          intermediate=gate_up.n // 2, gate_up=gate_up, down=down)
        return _Plan(attention, block, max_rows, attn, keep)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        plan, layer = self._plan, self.layer
        attn_module = layer.self_attn
        step, scratch = _step(meta, attn_module, positions, x.shape[0], plan)
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        out = torch.empty_like(x)
        lib, kernels = _library(), _kernels()
        status = lib.attention_block(kernels, ctypes.byref(plan.attention), step, x.data_ptr(), residual.data_ptr(),
                                     int(first), scratch.data_ptr(), out.data_ptr())
        if status:
            raise MemoryError("decode attention block could not allocate its scratch memory")
        if attn_module.o_proj.reduce_results:
            out = attn_module.o_proj.pc.all_reduce(out)
        mlp_out = torch.empty_like(x)
        status = lib.mlp_block(kernels, ctypes.byref(plan.mlp), step, out.data_ptr(), residual.data_ptr(),
                               scratch.data_ptr(), mlp_out.data_ptr())
        if status:
            raise MemoryError("decode MLP block could not allocate its scratch memory")
        if layer.mlp.down_proj.reduce_results:
            mlp_out = layer.mlp.down_proj.pc.all_reduce(mlp_out)
        return mlp_out, residual


def _step(meta: AttentionMetadata, attn_module: torch.nn.Module, positions: torch.Tensor, tokens: int,
          plan: _Plan) -> tuple[ctypes.Structure, torch.Tensor]:
    """The step's shared description and a scratch buffer large enough for every layer's blocks, built once per
    step (kept with the step's metadata, which every layer sees)."""
    attn = attn_module.attn
    key = ("fused_decode", attn.sliding_window, attn.chunk_size)
    cached = meta._masks.get(key)
    need = _scratch_floats(plan, tokens)
    if cached is None or cached[1].numel() < need:
        cos, sin = attn_module.rotary._step_cos_sin(positions, torch.float32)
        step, keep = step_description(meta, attn, tokens, cos, sin)
        cached = (ctypes.byref(step), torch.empty(need, dtype=torch.float32), step, keep)
        meta._masks[key] = cached
    return cached[0], cached[1]


def step_description(meta: AttentionMetadata, attn: torch.nn.Module, tokens: int, cos: torch.Tensor | None = None,
                     sin: torch.Tensor | None = None) -> tuple[_Step, tuple]:
    """A decode step's key ranges, slots and rotary cos/sin as the C blocks read them (cos/sin left for the callee
    when None), and the tensors it points into."""
    tables, first_keys, seq_lens = meta.decode_key_ranges(attn.sliding_window, attn.chunk_size)
    step = _Step(tokens=tokens, max_blocks=tables.shape[1], cos=_ptr(cos), sin=_ptr(sin),
                 block_tables=tables.data_ptr(), first_keys=first_keys.data_ptr(), seq_lens=seq_lens.data_ptr(),
                 slots=meta.slot_mapping.data_ptr(), threads=torch.get_num_threads())
    return step, (cos, sin, tables, first_keys, seq_lens, meta.slot_mapping)


def _scratch_floats(plan: _Plan, tokens: int) -> int:
    a, m = plan.attention, plan.mlp
    q_width = a.num_heads * a.head_dim
    attention = a.hidden + (q_width + 2 * a.num_kv_heads * a.head_dim) + 2 * q_width
    mlp = m.hidden + 3 * m.intermediate
    return tokens * max(attention, mlp)


class FusedDecodeStack:
    """A stage's decoder layers (and on the last stage the final norm) in one C call for a decode step without
    tensor parallelism: the per-layer path still paid about 60 us a layer in Python (module calls, `serves`, tensors
    for each block's output), more after the layers' weights streamed through the caches and left Python's code
    cold. Taken when every layer is a `FusedDecodeLayer` whose plan serves the step; anything else keeps the
    per-layer calls."""

    def __init__(self, layers: list[torch.nn.Module], final_norm: torch.nn.Module | None) -> None:
        self.final_norm = final_norm
        self.fused = [getattr(layer, "fused_decode", None) for layer in layers]
        self.enabled = bool(self.fused) and all(f is not None for f in self.fused)
        self._arrays: tuple | None = None  # (plans, their blocks as C arrays, the widest plan, the fewest rows)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                 meta: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output, residual) of the last layer, its output through the final norm when there is one (the residual
        then spent), or None when the step takes the per-layer path."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            return None
        blocks = self.blocks(x.shape[0], meta)
        if blocks is None:
            return None
        attention, mlp, widest = blocks
        step, scratch = _step(meta, self.fused[0].layer.self_attn, positions, x.shape[0], widest)
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        hidden, out = torch.empty_like(x), torch.empty_like(x)
        norm = self.final_norm
        status = _library().decode_layers(_kernels(), attention, mlp, len(self.fused), step, x.data_ptr(),
                                          residual.data_ptr(), int(first), scratch.data_ptr(), hidden.data_ptr(),
                                          out.data_ptr(), None if norm is None else norm.weight.data_ptr(),
                                          0.0 if norm is None else norm.eps)
        if status:
            raise MemoryError("decode layers could not allocate their scratch memory")
        return (out, residual) if norm is None else (hidden, residual)

    def blocks(self, rows: int, meta: object) -> tuple | None:
        """(attention blocks, MLP blocks, the plan needing the most scratch) as C arrays for a decode step of `rows`
        float32 CPU rows, or None when the step takes the per-layer path."""
        if not self.enabled or not _is_decode_step(meta, rows):
            return None
        arrays = self._arrays
        if arrays is None or not all(p.current for p in arrays[0]):  # the first decode, or caches bound anew
            plans = [f._plan if f.serves_rows(rows, meta) else None for f in self.fused]
            if any(p is None for p in plans):
                return None
            self._arrays = arrays = self._describe(plans)
            if arrays is None:
                self.enabled = False
                return None
        return arrays[1:4] if rows <= arrays[4] else None

    def _describe(self, plans: list[_Plan]) -> tuple | None:
        """The plans' blocks as C arrays, or None when the layers need the per-layer path (tensor parallelism's
        all-reduces between blocks, or layers that attend over different windows than the step describes)."""
        layers = [f.layer for f in self.fused]
        windows = {(layer.self_attn.attn.sliding_window, layer.self_attn.attn.chunk_size) for layer in layers}
        if len(windows) > 1 or any(layer.self_attn.o_proj.pc.tp_size > 1 for layer in layers):
            return None
        norm = self.final_norm
        if norm is not None and (type(norm).forward is not RMSNorm.forward or norm.weight.dtype != torch.float32):
            return None
        attention = (_AttentionBlock * len(plans))(*(p.attention for p in plans))
        mlp = (_MlpBlock * len(plans))(*(p.mlp for p in plans))
        widest = max(plans, key=lambda p: _scratch_floats(p, 1))
        return plans, attention, mlp, widest, min(p.max_rows for p in plans)
