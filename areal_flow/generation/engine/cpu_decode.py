"""Decode attention over the paged KV cache on the CPU, reading each row's blocks where they lie.

The torch path (decode.py's `_decode_attention`) gathers every decode row's context into one padded
[kv_heads, rows, width, head_dim] copy at every step and layer, then runs two batched matmuls over
it: on a multi-turn workload (contexts of 200-700 tokens, 64 rows) that copy was half the decode
attention's time, and the padding to the longest context made the matmuls read more than the rows
hold. This kernel walks each row's block table instead, one (row, KV head) at a time: the `group`
query heads that share the KV head score each key of the row's context, with an online softmax in
float32 (flash-decoding), so every key and value is read once, in place, and padded columns are
never touched. Each row is computed alone, in a fixed order, so its result does not depend on the
other rows (batch-invariant by construction).

It is a small C function compiled on first use with the machine's C compiler (`cc -O3
-march=native`), cached under the project's cache directory keyed by the source, the compiler and
the CPU's flags (a cache shared by machines with different CPUs keeps one build for each), and
called through ctypes, which releases the GIL: with several torch threads the rows are split over
as many Python threads. Written here rather than taken from a library because no kept CPU library
has paged attention: torch's CPU attention wants dense tensors, and flex_attention needs
torch.compile. Where no compiler is found, or the build fails, `available()` says False and the
engine keeps the torch path (one warning says why). float32 only; other dtypes keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 32

/* out[r, h*group + g, :] = softmax(scale * q . K_ctx) V_ctx for rows [first, last). */
void paged_decode(const float *q, const float *keys, const float *values, const int64_t *table,
                  const int64_t *lengths, float *out, int64_t first, int64_t last, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, int64_t slots_total, int64_t width,
                  int64_t block_size, float scale) {
    const int64_t group = heads / kv_heads;
    float s[group][TILE], m[group], l[group], acc[group][head_dim];
    int64_t slot[TILE];
    for (int64_t r = first; r < last; r++) {
        const int64_t length = lengths[r];
        const int64_t *blocks = table + r * width;
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *qh = q + (r * heads + h * group) * head_dim;
            const float *kh = keys + h * slots_total * head_dim, *vh = values + h * slots_total * head_dim;
            for (int64_t g = 0; g < group; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
                memset(acc[g], 0, sizeof(float) * head_dim);
            }
            int64_t block = 0, offset = 0;  /* where position `start` lies in the table */
            for (int64_t start = 0; start < length; start += TILE) {
                const int64_t n = length - start < TILE ? length - start : TILE;
                for (int64_t t = 0; t < n; t++) {  /* (no division a position: it costs as much as a dot) */
                    slot[t] = blocks[block] * block_size + offset;
                    if (++offset == block_size) {
                        offset = 0;
                        block++;
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * head_dim;
                    float best = m[g];
                    for (int64_t t = 0; t < n; t++) {
                        const float *k = kh + slot[t] * head_dim;
                        float dot = 0.0f;
                        for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * k[d];
                        s[g][t] = dot * scale;
                        best = s[g][t] > best ? s[g][t] : best;
                    }
                    const float correction = expf(m[g] - best);
                    l[g] *= correction;
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= correction;
                    for (int64_t t = 0; t < n; t++) {
                        const float w = expf(s[g][t] - best);
                        const float *v = vh + slot[t] * head_dim;
                        l[g] += w;
                        for (int64_t d = 0; d < head_dim; d++) acc[g][d] += w * v[d];
                    }
                    m[g] = best;
                }
            }
            float *o = out + (r * heads + h * group) * head_dim;
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < head_dim; d++) o[g * head_dim + d] = acc[g][d] / l[g];
        }
    }
}
"""
# Not -ffast-math: a shared library linked with it sets the CPU's flush-to-zero flags when it is
# loaded, for the whole process (every torch op after it would lose subnormal floats). These are
# the parts of it that let the compiler vectorize the sums.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-shared", "-fPIC"]
# Below this many (row, KV head) pairs a second thread costs more than it saves.
_ROWS_PER_THREAD = 8


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "areal_flow")
    return os.path.join(os.environ.get("AREAL_FLOW_CACHE", default), "kernels")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel (built once a machine and source; None where it cannot be built)."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler (cc/gcc, or $CC): decode attention on the CPU gathers each row's context "
                       "instead of reading the paged cache in place (slower on long contexts)")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), version, _cpu_flags()]).encode()).hexdigest()[:16]
        path = os.path.join(_cache_dir(), f"paged_decode_{key}.so")
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
                source, built = os.path.join(tmp, "paged_decode.c"), os.path.join(tmp, "paged_decode.so")
                with open(source, "w") as f:
                    f.write(_SOURCE)
                subprocess.run([compiler, *_FLAGS, source, "-o", built, "-lm"], check=True, capture_output=True,
                               text=True, timeout=120)
                os.replace(built, path)  # atomic: a concurrent build of the same key wins or loses whole
        library = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("building the CPU decode-attention kernel with %s failed (%s): decode attention gathers "
                       "each row's context instead", compiler, str(detail).strip()[:500])
        return None
    fn = library.paged_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float]
    return library


def available() -> bool:
    """Whether the kernel is built (or can be) on this machine and not turned off: AREAL_FLOW_CPU_KERNEL=0
    keeps torch's gathered attention (read each time: a benchmark compares the two in one process)."""
    return os.environ.get("AREAL_FLOW_CPU_KERNEL", "1") != "0" and _library() is not None


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="paged-decode")


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """One query per row q [rows, heads, head_dim] over its context in the paged cache: keys/values
    [kv_heads, slots, head_dim], the rows' block tables [rows, width] (int64) and context lengths
    [rows] (int64, each at least 1). Returns [rows, heads, head_dim]. float32 CPU tensors."""
    library = _library()
    if library is None or not available():
        raise RuntimeError("the CPU decode-attention kernel is not available here (cpu_decode.available())")
    rows, heads, head_dim = q.shape
    kv_heads, slots_total, _ = keys.shape
    if heads % kv_heads or q.dtype != torch.float32 or keys.dtype != torch.float32 or q.device.type != "cpu":
        raise ValueError(f"paged_decode_attention takes float32 CPU tensors with heads a multiple of kv_heads, got "
                         f"q {tuple(q.shape)} {q.dtype} on {q.device}, keys {tuple(keys.shape)} {keys.dtype}")
    q, table, lengths = q.contiguous(), table.contiguous(), lengths.contiguous()
    keys, values = keys.contiguous(), values.contiguous()  # (views of the pool: no copy)
    out = torch.empty_like(q)
    args = (q.data_ptr(), keys.data_ptr(), values.data_ptr(), table.data_ptr(), lengths.data_ptr(), out.data_ptr())
    shape = (heads, kv_heads, head_dim, slots_total, table.shape[1], block_size)

    def run(first: int, last: int) -> None:
        library.paged_decode(*args, first, last, *shape, scale)

    threads = min(torch.get_num_threads(), rows * kv_heads // _ROWS_PER_THREAD)
    if threads <= 1:
        run(0, rows)
    else:
        bounds = [rows * i // threads for i in range(threads + 1)]
        list(_pool(threads).map(run, bounds[:-1], bounds[1:]))
    return out
