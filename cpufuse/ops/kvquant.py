"""Quantized K/V cache rows (docs/semantics.md §4): Q8_0 and Q4_0 blocks of 32 values along the head
dimension, stored as uint8 arrays (..., D / 32 * bytes_per_block). flash_attn reads them with
k_type= / v_type=; these NumPy helpers write and read them (the model's cache is written by the
graph's kv_write)."""
import numpy as np

KV_TYPES = ("f32", "f16", "q8_0", "q4_0")
QUANT = {"q8_0": 34, "q4_0": 18}   # bytes per 32-value block
CODE = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}   # the FA_KF16 / FA_VF16 descriptor values


def check_kv_type(t, name):
    if not isinstance(t, str) or t.lower() not in KV_TYPES:
        raise ValueError(f"{name} must be one of {', '.join(KV_TYPES)}, got {t!r}")
    return t.lower()


def row_bytes(kv_type, D):
    """bytes of one cache row of D values"""
    if kv_type in QUANT:
        return D // 32 * QUANT[kv_type]
    return D * (4 if kv_type == "f32" else 2)


def _blocks(x):
    x = np.ascontiguousarray(x, np.float32)
    if x.shape[-1] % 32:
        raise ValueError(f"a quantized K/V row needs a length that is a multiple of 32, got {x.shape[-1]}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))


def quantize(x, kv_type):
    """float rows (..., D) -> uint8 blocks (..., D / 32 * bytes). q8_0: amax = max|x|,
    d = f2h(fl(amax / 127)), codes round_even(fl(x * fl(127 / amax))) (0 when amax = 0), as the matmul's
    activations (ggml's x86 quantize_row_q8_0). q4_0: ggml's: m = the value of largest |x| (first on
    ties), d = fl(m / -8), codes min(15, trunc(fl(fl(x * fl(1 / d)) + 8.5))) (8 when d = 0)."""
    b = _blocks(x)
    if kv_type == "q8_0":
        amax = np.max(np.abs(b), axis=-1)
        d = (amax / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            idv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.rint((b * idv[..., None]).astype(np.float32)).astype(np.int8)
        out = np.empty(b.shape[:-1] + (34,), np.uint8)
        out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
        out[..., 2:] = q.view(np.uint8)
    elif kv_type == "q4_0":
        i = np.argmax(np.abs(b), axis=-1)
        m = np.take_along_axis(b, i[..., None], -1)[..., 0]
        d = (m / np.float32(-8)).astype(np.float32)
        with np.errstate(divide="ignore"):
            idv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = ((b * idv[..., None]).astype(np.float32) + np.float32(8.5)).astype(np.float32)
        q = np.minimum(15, np.trunc(v)).astype(np.uint8)
        out = np.empty(b.shape[:-1] + (18,), np.uint8)
        out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
        out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    else:
        raise ValueError(f"kv_type must be q8_0 or q4_0, got {kv_type!r}")
    return out.reshape(x.shape[:-1] + (-1,))


def dequantize(b, kv_type, D):
    """uint8 blocks (..., D / 32 * bytes) -> float32 rows (..., D), exact"""
    b = np.asarray(b, np.uint8)
    blk = b.reshape(b.shape[:-1] + (D // 32, QUANT[kv_type]))
    d = np.ascontiguousarray(blk[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    if kv_type == "q8_0":
        q = np.ascontiguousarray(blk[..., 2:]).view(np.int8).astype(np.float32)
    else:
        c = blk[..., 2:]
        q = np.concatenate([c & 15, c >> 4], axis=-1).astype(np.float32) - 8
    return (d[..., None] * q).astype(np.float32).reshape(b.shape[:-1] + (D,))
