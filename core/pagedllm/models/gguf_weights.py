"""GGUF checkpoints read through the ``gguf`` package directly: HF-named tensors, dense or still block-quantized.

llama.cpp's converter permutes the rows of Llama q/k projections (its rotary layout); rows are undone here, on the
packed blocks or the dense tensor alike (a row permutation never splits a block, blocks run along a row).
MoE experts are stacked in GGUF (``blk.N.ffn_{gate,up,down}_exps``: ``[experts, out, in]``); an HF per-expert name
(``mlp.experts.J.gate_proj.weight``) reads expert J of the stack.
DeepSeek (``deepseek2``): newer converters split ``kv_b_proj`` per head into ``attn_k_b`` (transposed: ``[heads,
kv_lora_rank, nope]``) and ``attn_v_b`` (``[heads, v, kv_lora_rank]``); ``kv_b_proj`` is rebuilt from the two.
Falcon: the converter reorders ``query_key_value`` from HF's per-KV-group ``[q.., k, v]`` to all queries, then all
keys, then all values (identity for multi-query Falcon-7B); rows are put back per group here.
Granite-4.0-H (``granitehybrid``): q/k rows as Llama's; the rest (Mamba2 transforms, the split ``input_linear``) is
undone by ``gguf_granite_hybrid``.
GPT-OSS (``gpt-oss``): sinks renamed, ``gate_up_proj`` split into gate and up, expert transposes: undone by
``gguf_gpt_oss`` (expert stacks, MXFP4 included, are read dense).
"""

from __future__ import annotations

import mmap
import re
import warnings
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np
import torch

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.models.gguf_gpt_oss import ARCH as GPT_OSS_ARCH, GptOssLayout
from pagedllm.models.gguf_granite_hybrid import ARCH as GRANITE_HYBRID_ARCH, GraniteHybridLayout
from pagedllm.models.gguf_qwen35 import (QWEN35_GGUF_ARCHS, Qwen35Layout,
    converter_name as qwen35_converter_name)
from pagedllm.models.gguf_ssm import converter_name, undo_converter
from pagedllm.quantization.gguf import DENSE_TYPES


_NUMPY_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


class GGUFTensor(NamedTuple):
    """One tensor as ``gguf.GGUFReader`` presents it: ``shape`` innermost first, ``data`` a read-only memmap view
    (``[rows, row bytes]`` for block types)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def read_tensors(path: str) -> tuple[str, list[GGUFTensor]]:
    """(architecture, tensors) of a GGUF file. transformers' header reader parses only the tensor table (~10 ms for
    SmolLM2); ``gguf.GGUFReader`` also parses every metadata array (2.2 s for its 49k-token vocabulary), so it is
    the fallback for transformers versions without one, and for files holding a type transformers' reader cannot
    size (MXFP4: GPT-OSS's experts)."""
    import gguf  # heavy: gguf

    try:
        from transformers.integrations.gguf.reader import GgufHeader  # heavy: transformers

        header = GgufHeader.from_file(path)
    except (ImportError, ValueError):
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode(), [
            GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data) for t in reader.tensors]
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for info in header.tensors:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        raw = blob[header.data_start + info.offset: header.data_start + info.offset + info.nbytes]
        if qtype.name in _NUMPY_TYPES:  # as GGUFReader: plain arrays, and raw bytes for everything else (BF16 too)
            data = raw.view(_NUMPY_TYPES[qtype.name]).reshape(info.shape)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            data = raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)
        tensors.append(GGUFTensor(info.name, qtype, tuple(reversed(info.shape)), data))
    return header.architecture, tensors


#: Dropped beyond each side of a tensor: the kernel maps the cached pages around a faulting one (fault-around, 64 KiB
#: by default), so reading a tensor maps the tail of the one read before it again.
_DROP_MARGIN = 1 << 20


def drop_pages(data: np.ndarray) -> None:
    """Unmap the file pages ``data`` (a view of the file's memmap) was read through, once it has been copied: they
    count towards the process's RSS for as long as the mapping lives (the whole file, ~100 MB for SmolLM2, at the
    load's peak), and stay in the page cache for a later read."""
    root = data
    while isinstance(root.base, np.ndarray):
        root = root.base
    mm = root.base
    if not isinstance(mm, mmap.mmap) or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = data.ctypes.data - np.frombuffer(mm, dtype=np.uint8).ctypes.data
    first = max(0, start - _DROP_MARGIN)
    first -= first % mmap.PAGESIZE
    mm.madvise(mmap.MADV_DONTNEED, first, min(start + data.nbytes + _DROP_MARGIN, len(mm)) - first)


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor a module holds: parameters, buffers, and kernel states (tensors in attributes, tuples, lists)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            for key, value in vars(m).items():
                if key != "_modules":
                    yield from _tensors(value, depth + 1)
    elif isinstance(obj, dict) and depth < 6:
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif isinstance(obj, (list, tuple)) and depth < 6:
        for value in obj:
            yield from _tensors(value, depth + 1)


def _storages(holder: Any) -> set[int]:
    """Addresses of the storages ``holder``'s tensors use (oneDNN's packed, opaque weights are copies)."""
    return {t.untyped_storage().data_ptr() for t in _tensors(holder) if t.layout == torch.strided and not t.is_mkldnn}


def drop_unless_kept(view: np.ndarray, data: torch.Tensor, holder: Any) -> None:
    """``drop_pages(view)`` unless ``holder`` (a module, a kernel's state) keeps ``data``, the tensor over ``view``:
    a kernel that made its own copy (a repacked layout) leaves the file's pages to whoever still reads them."""
    if data.untyped_storage().data_ptr() not in _storages(holder):
        drop_pages(view)


#: An HF per-expert tensor name: (stacked module, expert index, projection).
_EXPERT = re.compile(r"(.*\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")
#: An HF per-head norm (StableLM's ``q_layernorm.norms.H.weight``): row H of the converter's stacked ``attn_q_norm``.
_HEAD_NORM = re.compile(r"(.*\.self_attn\.[qk]_layernorm)\.norms\.(\d+)\.weight")


def _stacked(name: str) -> Optional[tuple[str, int]]:
    """(the stacked tensor's HF name, index in it) of one expert's or one head's tensor; None for the rest."""
    m = _EXPERT.fullmatch(name)
    if m:
        return f"{m[1]}.{m[3]}.weight", int(m[2])
    m = _HEAD_NORM.fullmatch(name)
    return (f"{m[1]}.weight", int(m[2])) if m else None


#: GGUF architectures whose converter permutes q/k rows (HF rotate_half layout -> GGML's interleaved pairs).
_PERMUTED_QK_ARCHS = ("llama", "baichuan", GRANITE_HYBRID_ARCH)


#: GGUF architectures whose converter writes RMSNorm weights as ``1 + w`` (Gemma's ``(1 + w)`` norm folded in).
_ONE_PLUS_NORM_ARCHS = ("gemma", "gemma2", "gemma3")


class GGUFWeights:
    """A ``WeightSource`` over a ``.gguf`` file (memory-mapped)."""

    def __init__(self, path: str, config: Any):
        import gguf  # heavy: gguf

        self.arch, tensors = read_tensors(path)
        arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[self.arch]
        self._map = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
        self._tensors = {t.name: t for t in tensors}
        heads = getattr(config, "num_attention_heads", None) or 1  # (pure Mamba2: no attention)
        self._heads = {"attn_q": heads, "attn_k": getattr(config, "num_key_value_heads", None) or heads}
        self._falcon_groups = (config.num_kv_heads if getattr(config, "new_decoder_architecture", False) else 1)
        self._qwen35 = Qwen35Layout(config, self.arch) if self.arch in QWEN35_GGUF_ARCHS else None  # gguf_qwen35.py
        self._granite = (GraniteHybridLayout(self._tensors.__contains__) if self.arch == GRANITE_HYBRID_ARCH
                         else None)  # gguf_granite_hybrid.py
        self._gpt_oss = (GptOssLayout({t.name: t.tensor_type.name for t in tensors}) if self.arch == GPT_OSS_ARCH
                         else None)  # gguf_gpt_oss.py
        self._in_place: dict[int, np.ndarray] = {}  # quantized()'s views of the mapping, by address, until release

    def gguf_name(self, name: str) -> Optional[str]:
        if name.endswith("e_score_correction_bias"):  # the converter writes it as ``...e_score_correction.bias``
            name = name.removesuffix("_bias") + ".bias"
        s = _stacked(name)
        if s:  # one expert (or head) of a stacked tensor
            return self._map.get_name(s[0], try_suffixes=(".weight",))
        if self._granite is not None:
            return self._granite.gguf_name(name) or self._map.get_name(
                self._granite.converter_name(name), try_suffixes=(".weight", ".bias"))
        if self._gpt_oss is not None:
            return self._gpt_oss.gguf_name(name) or self._map.get_name(name, try_suffixes=(".weight", ".bias"))
        name = converter_name(self.arch, name) if self._qwen35 is None else qwen35_converter_name(name)
        return self._map.get_name(name, try_suffixes=(".weight", ".bias"))

    def _split_kv_b(self, name: str) -> Optional[tuple[GGUFTensor, GGUFTensor]]:
        """(attn_k_b, attn_v_b) when ``name`` is a ``kv_b_proj`` the file holds only split."""
        g = self.gguf_name(name) if name.endswith("self_attn.kv_b_proj.weight") else None
        if g is None or g in self._tensors:
            return None
        parts = [self._tensors.get(g.replace("attn_kv_b", kind)) for kind in ("attn_k_b", "attn_v_b")]
        return None if None in parts else tuple(parts)

    def _split_qkvz(self, name: str) -> Optional[tuple[GGUFTensor, GGUFTensor]]:
        """(attn_qkv, attn_gate) when ``name`` is a Qwen3-Next ``in_proj_qkvz`` the file holds only split."""
        g = self.gguf_name(name) if name.endswith("linear_attn.in_proj_qkvz.weight") else None
        if g is None or g in self._tensors:
            return None
        parts = [self._tensors.get(g.replace("ssm_in", kind)) for kind in ("attn_qkv", "attn_gate")]
        return None if None in parts else tuple(parts)

    def _split_granite(self, name: str) -> Optional[tuple[list[GGUFTensor], int]]:
        """(the parts, numpy axis to join them on) of a Granite-4.0-H ``input_linear`` the converter split."""
        found = self._granite.parts(name) if self._granite is not None else None
        if found is None or not all(g in self._tensors for g in found[0]):
            return None
        return [self._tensors[g] for g in found[0]], found[1]

    def _split_gpt_oss(self, name: str) -> Optional[list[GGUFTensor]]:
        """(gate, up) of a GPT-OSS ``gate_up_proj`` (or its bias) the converter split."""
        found = self._gpt_oss.parts(name) if self._gpt_oss is not None else None
        if found is None or not all(g in self._tensors for g in found):
            return None
        return [self._tensors[g] for g in found]

    def __contains__(self, name: str) -> bool:
        g = self.gguf_name(name)
        if g is None or g not in self._tensors:
            return (self._split_kv_b(name) is not None or self._split_qkvz(name) is not None
                    or self._split_granite(name) is not None or self._split_gpt_oss(name) is not None)
        s = _stacked(name)
        return s is None or s[1] < self._tensors[g].data.shape[0]

    def _tensor(self, name: str) -> GGUFTensor:
        """The GGUF tensor holding ``name``; for one expert (or head), its slice of the stack."""
        if name not in self:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        t = self._tensors[self.gguf_name(name)]
        s = _stacked(name)
        return t if s is None else GGUFTensor(t.name, t.tensor_type, t.shape[:-1], t.data[s[1]])

    def _rows(self, gname: str, n: int) -> Optional[np.ndarray]:
        """The row order undoing llama.cpp's q/k permute (None: rows are already in HF order)."""
        if self._qwen35 is not None:
            return self._qwen35.row_order(gname)
        kind = gname.split(".")[-2] if gname.startswith("blk.") else ""
        if self.arch == "falcon" and kind == "attn_qkv" and self._falcon_groups > 1:
            g, d = self._falcon_groups, n // (self._heads["attn_q"] + 2 * self._falcon_groups)
            r = self._heads["attn_q"] // g  # queries per group
            q = np.arange(g * r * d).reshape(g, r * d)
            k, v = (g * r * d + np.arange(g * d).reshape(g, d) + i * g * d for i in (0, 1))
            return np.concatenate([q, k, v], axis=1).reshape(n)
        if self.arch not in _PERMUTED_QK_ARCHS or kind not in self._heads:
            return None
        h = self._heads[kind]
        return np.arange(n).reshape(h, n // h // 2, 2).swapaxes(2, 1).reshape(n)

    def weight_type(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def take(self, name: str) -> torch.Tensor:
        """Dense float32 (block types dequantized by ``gguf.quants``)."""
        from gguf.quants import dequantize  # heavy: gguf

        split = self._split_kv_b(name)
        if split is not None:  # [heads, nope + v, kv_lora_rank] from k_b transposed back and v_b
            k_b, v_b = (np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in split)
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
            return torch.from_numpy(np.ascontiguousarray(kv_b.reshape(-1, kv_b.shape[-1])))
        split = self._split_qkvz(name)
        if split is not None:  # Qwen3-Next's [q, k, v, z] per key head from attn_qkv and attn_gate
            qkv, z = (np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in split)
            return torch.from_numpy(self._qwen35.fuse_qkvz(qkv, z))
        granite = self._split_granite(name)
        if granite is not None:  # Granite-4.0-H's input_linear: gate rows, then up rows
            parts, axis = granite
            joined = np.concatenate([np.asarray(t.data if t.tensor_type.name == "F32" else
                                                dequantize(t.data, t.tensor_type), dtype=np.float32)
                                     for t in parts], axis=axis)
            for t in parts:
                drop_pages(t.data)
            return torch.from_numpy(joined)
        gate_up = self._split_gpt_oss(name)
        if gate_up is not None:  # GPT-OSS's gate_up_proj (or bias): gate and up transposed back, re-interleaved
            joined = self._gpt_oss.join(*(np.asarray(t.data if t.tensor_type.name == "F32" else
                                                     dequantize(t.data, t.tensor_type), dtype=np.float32)
                                          for t in gate_up))
            for t in gate_up:
                drop_pages(t.data)
            return torch.from_numpy(joined)
        t = self._tensor(name)
        data = t.data if t.tensor_type.name in ("F32",) else dequantize(t.data, t.tensor_type)
        data = np.asarray(data, dtype=np.float32)
        if self.arch in _ONE_PLUS_NORM_ARCHS and t.name.endswith("norm.weight"):
            data = data - 1  # stored as 1 + w (llama.cpp's converter), as transformers' Gemma2TensorProcessor undoes
        if t.name.endswith("ffn_gate_inp_shexp.weight") and data.ndim == 1:
            data = data[None]  # llama.cpp stores the shared-expert gate as [hidden]; HF's is [1, hidden]
        undone = (undo_converter(self.arch, t.name, data) if self._granite is None  # LFM2 / Mamba2: gguf_ssm.py
                  else self._granite.undo(t.name, data))
        if self._gpt_oss is not None:
            undone = self._gpt_oss.undo(t.name, data)
        if undone is not None:
            data = undone
        if self._qwen35 is not None:
            data = self._qwen35.undo(t.name, data)
        rows = self._rows(t.name, data.shape[0])
        if rows is not None:
            data = data[rows]
        elif not data.flags.writeable:  # still the read-only mmap (F32): own a copy; dequantized data is owned
            data = data.copy()
        drop_pages(t.data)
        return torch.from_numpy(data)

    def blocks(self, name: str) -> Optional[GGUFTensor]:
        """The file's own tensor for ``name`` (``data``: its read-only mapping, not copied) when it is a 2-D block
        type with rows in HF order; None otherwise."""
        if (name not in self or self._split_qkvz(name) is not None or self._split_granite(name) is not None
                or self._split_gpt_oss(name) is not None):
            return None
        t = self._tensor(name)
        if t.tensor_type.name in DENSE_TYPES or len(t.shape) != 2 or self._rows(t.name, t.data.shape[0]) is not None:
            return None
        if self._qwen35 is not None and self._qwen35.column_order(t.name) is not None:
            return None
        return t

    def quantized(self, name: str) -> Optional[QuantizedWeight]:
        """The packed blocks of a 2-D block-quantized tensor, rows in HF order; None for dense tensors."""
        if (self._split_kv_b(name) is not None or self._split_qkvz(name) is not None
                or self._split_gpt_oss(name) is not None):
            return None
        granite = self._split_granite(name)
        if granite is not None:  # a 2-D input_linear whose parts share a block type: their packed rows joined
            parts, axis = granite
            if axis != 0 or len({p.tensor_type for p in parts}) != 1 or parts[0].tensor_type.name in DENSE_TYPES:
                return None
            raw = np.concatenate([np.asarray(p.data) for p in parts])
            for p in parts:
                drop_pages(p.data)
            return QuantizedWeight("gguf", parts[0].tensor_type.name, torch.from_numpy(raw),
                                   (raw.shape[0], int(parts[0].shape[0])))
        t = self._tensor(name)
        if t.tensor_type.name in DENSE_TYPES or len(t.shape) != 2:
            return None
        if self._qwen35 is not None and self._qwen35.column_order(t.name) is not None:
            return None  # out_proj's columns are reordered: read dense (``take``)
        raw = np.asarray(t.data)
        rows = self._rows(t.name, raw.shape[0])
        if rows is None:  # the file's bytes in place (``release`` unmaps them unless the kernel keeps them)
            with warnings.catch_warnings():  # the mapping is read-only; kernels only read their weights
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(raw)
            self._in_place[data.data_ptr()] = t.data
        else:  # owned rows, permuted
            data = torch.from_numpy(raw[rows])
            drop_pages(t.data)
        in_features, out_features = (int(d) for d in t.shape)  # GGUF lists dims innermost first
        return QuantizedWeight("gguf", t.tensor_type.name, data, (out_features, in_features))

    def release(self, parts: list[Optional[QuantizedWeight]], module: torch.nn.Module) -> None:
        """Unmap the file pages of ``parts`` (from ``quantized``) that ``module``'s kernels did not keep: a repacked,
        fused or dequantized copy replaces them, and read pages count towards RSS for as long as the file is mapped.
        Parts the kernel reads in place (CPU Q8_0 and K-quants) stay the file's pages, as llama.cpp's mmap: no
        anonymous copy, shared with the page cache."""
        kept = _storages(module)
        for p in parts:
            view = None if p is None else self._in_place.pop(p.data.data_ptr(), None)
            if view is not None and p.data.untyped_storage().data_ptr() not in kept:
                drop_pages(view)
