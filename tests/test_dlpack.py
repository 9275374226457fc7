"""The DLPack boundary of hexiseq.ops: both capsule kinds, renaming, deleters called once, no leaks, bad inputs.

Hand-made capsules are built with ctypes from the DLPack 1.0 layout (declared independently of
csrc/common/dlpack.h, from the same specification) so that flags, versions, devices and deleter calls can be
controlled and counted; real ones come from NumPy and PyTorch.
"""

import contextlib
import ctypes
import gc
import math
import sys

import numpy as np
import pytest

import hexiseq
from hexiseq import InvalidArgumentError, ops
from hexiseq.errors import UnsupportedError

# ------------------------------------------------------------------------------------------------ ctypes

PyCapsule_GetName = ctypes.pythonapi.PyCapsule_GetName
PyCapsule_GetName.restype = ctypes.c_char_p
PyCapsule_GetName.argtypes = [ctypes.py_object]
PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
PyCapsule_IsValid.restype = ctypes.c_int
PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


READ_ONLY, IS_COPIED = 1, 2
KDLCPU, KDLCUDA = 1, 2


class Crafted:
    """An object whose __dlpack__ returns a hand-made capsule over `arr` (kept alive here), counting deleter
    calls. versioned=False makes a legacy capsule and rejects max_version with TypeError, like an old producer."""

    def __init__(self, arr, versioned=True, flags=0, major=1, device=KDLCPU, deleter=True, byte_offset=0,
                 strides=True):
        self.arr = arr
        self.versioned = versioned
        self.kw = dict(flags=flags, major=major, device=device, deleter=deleter, byte_offset=byte_offset,
                       strides=strides)
        self.deleted = 0
        self.calls = []
        self.capsules = []
        self.keep = []
        self.shape = arr.shape

    def _on_delete(self, ptr):
        self.deleted += 1

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        if not self.versioned and kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        kw = self.kw
        arr = self.arr
        m = DLManagedTensorVersioned() if self.versioned else DLManagedTensor()
        shape = (ctypes.c_int64 * arr.ndim)(*arr.shape)
        strides = (ctypes.c_int64 * arr.ndim)(*(s // arr.itemsize for s in arr.strides))
        t = m.dl_tensor
        t.data = arr.ctypes.data - kw["byte_offset"]
        t.byte_offset = kw["byte_offset"]
        t.device = DLDevice(kw["device"], 0)
        t.ndim = arr.ndim
        code = {"f": 2}[arr.dtype.kind]
        t.dtype = DLDataType(code, arr.dtype.itemsize * 8, 1)
        t.shape = shape
        t.strides = strides if kw["strides"] else None
        cb = DELETER(self._on_delete)
        if kw["deleter"]:
            m.deleter = cb
        if self.versioned:
            m.version = DLPackVersion(kw["major"], 0)
            m.flags = kw["flags"]
        name = ctypes.create_string_buffer(b"dltensor_versioned" if self.versioned else b"dltensor")
        self.keep += [m, shape, strides, cb, name]  # ctypes memory must outlive the capsule
        cap = PyCapsule_New(ctypes.addressof(m), ctypes.addressof(name), None)
        self.capsules.append(cap)
        return cap


class Forward:
    """Wraps a real tensor: its __dlpack__ forwards to the tensor's and keeps the capsule for inspection.
    legacy=True drops max_version (the producer then returns an unversioned capsule)."""

    def __init__(self, x, legacy=False):
        self.x = x
        self.legacy = legacy
        self.capsules = []
        self.shape = x.shape

    def __dlpack__(self, **kwargs):
        if self.legacy:
            if kwargs:
                raise TypeError("no max_version here")
            cap = self.x.__dlpack__()
        else:
            cap = self.x.__dlpack__(**kwargs)
        self.capsules.append(cap)
        return cap

    def __dlpack_device__(self):
        return self.x.__dlpack_device__()


def cap_name(cap):
    return PyCapsule_GetName(cap).decode()


def small(rng, B=1, S=5, H=2, D=8, dtype=np.float64):
    q = rng.standard_normal((B, S, H, D)).astype(dtype)
    k = rng.standard_normal((B, S, H, D)).astype(dtype)
    v = rng.standard_normal((B, S, H, D)).astype(dtype)
    return q, k, v


def lse_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


# ------------------------------------------------------------------------------------------------ protocol

@pytest.mark.parametrize("versioned", [True, False])
def test_crafted_capsules_consumed_renamed_deleted_once(versioned):
    rng = np.random.default_rng(0)
    q, k, v = small(rng)
    out, lse = np.empty_like(q), np.empty((1, 2, 5))
    wrapped = [Crafted(x, versioned=versioned) for x in (q, k, v, out, lse)]
    ops.attention_forward(*wrapped[:3], out=wrapped[3], lse=wrapped[4])
    ref_o, ref_l = ops.attention_forward(q, k, v)
    assert np.array_equal(out, ref_o) and np.array_equal(lse, ref_l)
    for w in wrapped:
        assert w.deleted == 1
        assert len(w.capsules) == 1
        cap = w.capsules[0]
        used = "used_dltensor_versioned" if versioned else "used_dltensor"
        assert cap_name(cap) == used
        assert PyCapsule_IsValid(cap, b"dltensor_versioned" if versioned else b"dltensor") == 0
        if versioned:
            assert w.calls == [{"max_version": (1, 0)}]
        else:  # max_version first, the TypeError fallback second
            assert w.calls == [{"max_version": (1, 0)}, {}]


def test_crafted_byte_offset_null_strides_null_deleter():
    rng = np.random.default_rng(1)
    q, k, v = small(rng)
    out = np.empty_like(q)
    ops.attention_forward(Crafted(q, byte_offset=64), Crafted(k, strides=False), Crafted(v, deleter=False),
                          out=Crafted(out, byte_offset=8, strides=False), lse=np.empty((1, 2, 5)))
    assert np.array_equal(out, ops.attention_forward(q, k, v)[0])


@pytest.mark.parametrize("bad", ["major", "read_only_out", "copied_out", "cuda", "dtype_of_v"])
def test_crafted_rejections_still_release_everything(bad):
    rng = np.random.default_rng(2)
    q, k, v = small(rng)
    out, lse = np.empty_like(q), np.empty((1, 2, 5))
    kw = {"major": dict(major=2), "read_only_out": dict(flags=READ_ONLY), "copied_out": dict(flags=IS_COPIED),
          "cuda": dict(device=KDLCUDA), "dtype_of_v": {}}[bad]
    target = {"major": 1, "read_only_out": 3, "copied_out": 3, "cuda": 0, "dtype_of_v": 2}[bad]
    arrs = [q, k, v.astype(np.float32) if bad == "dtype_of_v" else v, out, lse]
    wrapped = [Crafted(a, **(kw if i == target else {})) for i, a in enumerate(arrs)]
    expected_name = ["q", "k", "v", "out", "lse"][target]
    with pytest.raises(hexiseq.HexiseqError) as info:
        ops.attention_forward(*wrapped[:3], out=wrapped[3], lse=wrapped[4])
    assert str(info.value).startswith(expected_name)
    if bad in ("major", "cuda"):
        assert isinstance(info.value, UnsupportedError)
    # refused while importing (stop there) or when checking the whole call (after importing all five)
    last = target if bad in ("major", "copied_out", "cuda") else 4
    for i, w in enumerate(wrapped):  # consumed ones released exactly once, later ones never asked
        assert w.deleted == (1 if i <= last else 0), (i, w.deleted)
        assert len(w.capsules) == (1 if i <= last else 0)
    if bad == "read_only_out":
        assert "read-only" in str(info.value)
    if bad == "major":
        assert "version 2.0" in str(info.value)
    if bad == "cuda":
        assert "kDLCUDA" in str(info.value)


def test_read_only_input_versioned_ok():
    rng = np.random.default_rng(3)
    q, k, v = small(rng)
    q.flags.writeable = False  # NumPy exports it only as a versioned capsule with the READ_ONLY flag
    out, lse = ops.attention_forward(q, Crafted(k, flags=READ_ONLY), v)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("legacy", [False, True])
def test_numpy_capsules(legacy):
    rng = np.random.default_rng(4)
    q, k, v = small(rng)
    out, lse = np.empty_like(q), np.empty((1, 2, 5))
    w = [Forward(x, legacy=legacy) for x in (q, k, v, out, lse)]
    ops.attention_forward(*w[:3], out=w[3], lse=w[4])
    assert np.array_equal(out, ops.attention_forward(q, k, v)[0])
    for x in w:
        assert cap_name(x.capsules[0]) == ("used_dltensor" if legacy else "used_dltensor_versioned")


@pytest.mark.parametrize("legacy", [False, True])
def test_torch_capsules(legacy):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 5, 2, 8, dtype=torch.float64) for _ in range(3))
    out = torch.empty(1, 5, 2, 8, dtype=torch.float64)
    lse = torch.empty(1, 2, 5, dtype=torch.float64)
    w = [Forward(x, legacy=legacy) for x in (q, k, v, out, lse)]
    ops.attention_forward(*w[:3], out=w[3], lse=w[4])
    ref_o, ref_l = ops.attention_forward(q, k, v)
    assert torch.equal(out, ref_o) and torch.equal(lse, ref_l)
    for x in w:
        assert cap_name(x.capsules[0]) == ("used_dltensor" if legacy else "used_dltensor_versioned")


def test_torch_storage_offset_and_bf16():
    torch = pytest.importorskip("torch")
    base = torch.randn(3, 5, 2, 8, dtype=torch.float64)
    q = base[1:2]  # non-zero storage offset
    out, _ = ops.attention_forward(q, q, q)
    ref, _ = ops.attention_forward(q.clone(), q.clone(), q.clone())
    assert torch.equal(out, ref)
    qb = base.to(torch.bfloat16)[2:]
    ob, lb = ops.attention_forward(qb, qb, qb)
    assert ob.dtype == torch.bfloat16 and lb.dtype == torch.float32


def test_refcounts_return_to_baseline_numpy():
    rng = np.random.default_rng(5)
    q, k, v = small(rng)
    out, lse = np.empty_like(q), np.empty((1, 2, 5))
    do, dq, dk, dv = np.ones_like(q), np.empty_like(q), np.empty_like(k), np.empty_like(v)
    arrs = (q, k, v, out, lse, do, dq, dk, dv)
    ops.attention_forward(q, k, v, out=out, lse=lse)
    gc.collect()
    base = [sys.getrefcount(a) for a in arrs]
    for _ in range(300):
        ops.attention_forward(q, k, v, out=out, lse=lse)
        ops.attention_backward(q, k, v, out, lse, do, dq=dq, dk=dk, dv=dv)
        ops.merge_(out, lse, q, lse.copy())
    gc.collect()
    assert [sys.getrefcount(a) for a in arrs] == base


def test_refcounts_return_to_baseline_on_errors():
    rng = np.random.default_rng(6)
    q, k, v = small(rng)
    bad_v = v.astype(np.float32)
    out, lse = np.empty_like(q), np.empty((1, 2, 5))
    arrs = (q, k, bad_v, out, lse)
    base = [sys.getrefcount(a) for a in arrs]
    for _ in range(200):
        with pytest.raises(InvalidArgumentError):
            ops.attention_forward(q, k, bad_v, out=out, lse=lse)
        with pytest.raises(InvalidArgumentError):
            ops.attention_forward(q, k, v, out=q, lse=lse)
    gc.collect()
    assert [sys.getrefcount(a) for a in arrs] == base


def test_refcounts_return_to_baseline_torch():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    out, lse = torch.empty(1, 5, 2, 8), torch.empty(1, 2, 5)
    arrs = (q, k, v, out, lse)
    ops.attention_forward(q, k, v, out=out, lse=lse)
    gc.collect()
    base = [sys.getrefcount(a) for a in arrs]
    for _ in range(300):
        ops.attention_forward(q, k, v, out=out, lse=lse)
    gc.collect()
    assert [sys.getrefcount(a) for a in arrs] == base


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_no_memory_growth_over_thousands_of_calls():
    """Fresh 16 KiB tensors each call: a missed deleter would keep ~80 KiB per call alive (> 300 MiB)."""
    rng = np.random.default_rng(7)
    q0 = rng.standard_normal((1, 64, 2, 16))

    def step():
        q, k, v = q0.copy(), q0.copy(), q0.copy()
        out, lse = ops.attention_forward(q, k, v)
        ops.merge_(out, lse, q, lse.copy())

    for _ in range(300):
        step()
    gc.collect()
    before = rss_bytes()
    for _ in range(4000):
        step()
    gc.collect()
    assert rss_bytes() - before < 32 * 2**20


def test_no_memory_growth_torch():
    torch = pytest.importorskip("torch")
    q0 = torch.randn(1, 64, 2, 16)

    def step():
        q = q0.clone()
        out, lse = ops.attention_forward(q, q0.clone(), q0.clone())
        ops.attention_backward(q, q0, q0, out, lse, q0.clone())

    for _ in range(200):
        step()
    gc.collect()
    before = rss_bytes()
    for _ in range(2000):
        step()
    gc.collect()
    assert rss_bytes() - before < 32 * 2**20


def test_gil_released_results_correct_from_threads():
    import threading
    rng = np.random.default_rng(8)
    q, k, v = small(rng, S=97, D=16)
    ref, _ = ops.attention_forward(q, k, v)
    errors = []

    def work():
        for _ in range(20):
            o, _ = ops.attention_forward(q, k, v)
            if not np.array_equal(o, ref):
                errors.append("mismatch")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ------------------------------------------------------------------------------------------------ bad inputs

@contextlib.contextmanager
def raises(cls, *words):
    """pytest.raises whose message must contain every word (the argument name, the expectation)."""
    with pytest.raises(cls) as info:
        yield info
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)


@pytest.fixture
def qkv():
    rng = np.random.default_rng(9)
    return small(rng, B=2, S=7, H=4, D=8)


def test_bad_dtypes(qkv):
    q, k, v = qkv
    with raises(UnsupportedError, "q", "float64, float32, float16 or bfloat16", "int32"):
        ops.attention_forward(q.astype(np.int32), k, v)
    with raises(InvalidArgumentError, "k", "float64", "float32"):
        ops.attention_forward(q, k.astype(np.float32), v)
    with raises(InvalidArgumentError, "lse", "float32", "float64"):
        ops.attention_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                              lse=np.empty((2, 4, 7)))
    with raises(InvalidArgumentError, "out", "float64"):
        ops.attention_forward(q, k, v, out=np.empty(q.shape, np.float32))
    with raises(UnsupportedError, "q", "complex128"):
        ops.attention_forward(q.astype(np.complex128), k, v)


def test_bad_shapes(qkv):
    q, k, v = qkv
    assert issubclass(InvalidArgumentError, ValueError)
    with raises(InvalidArgumentError, "k", "head_dim = 8"):
        ops.attention_forward(q, k[..., :4], v)
    with raises(InvalidArgumentError, "v", "same as k", "[2, 7, 4, 8]"):
        ops.attention_forward(q, k, v[:, :5])
    with raises(InvalidArgumentError, "out", "[batch, seq_q, heads, head_dim]", "[2, 7, 4, 8]"):
        ops.attention_forward(q, k, v, out=np.empty((2, 7, 4, 4)))
    with raises(InvalidArgumentError, "lse", "[batch, heads, seq_q]", "[2, 4, 7]"):
        ops.attention_forward(q, k, v, lse=np.empty((2, 7, 4)))
    with raises(InvalidArgumentError, "multiple", "k.shape[2] = 3"):
        ops.attention_forward(q, k[:, :, :3], v[:, :, :3])
    with raises(ValueError, "q", "4-D"):
        ops.attention_forward(q[0], k, v)
    with raises(InvalidArgumentError, "dk", "same as k"):
        o, l = ops.attention_forward(q, k, v)
        ops.attention_backward(q, k, v, o, l, q.copy(), dk=np.empty((2, 7, 2, 8)))
    with raises(InvalidArgumentError, "out_part", "same as out_acc"):
        ops.merge_(np.zeros((2, 7, 4, 8)), np.zeros((2, 4, 7)), np.zeros((2, 7, 4, 4)), np.zeros((2, 4, 7)))
    with raises(InvalidArgumentError, "head_dim", ">= 1"):
        ops.attention_forward(q[..., :0], k[..., :0], v[..., :0])


def test_unsupported_head_dim():
    q = np.zeros((1, 3, 1, 512))
    with raises(UnsupportedError, "head_dim", "256", "512"):
        ops.attention_forward(q, q, q)


def test_read_only_outputs(qkv):
    q, k, v = qkv
    out = np.empty_like(q)
    out.flags.writeable = False
    with raises(InvalidArgumentError, "out", "read-only"):
        ops.attention_forward(q, k, v, out=out)
    o, l = ops.attention_forward(q, k, v)
    l.flags.writeable = False
    with raises(InvalidArgumentError, "lse_acc", "read-only"):
        ops.merge_(o, l, o.copy(), l.copy())
    dv = np.empty_like(v)
    dv.flags.writeable = False
    with raises(InvalidArgumentError, "dv", "read-only"):
        ops.attention_backward(q, k, v, o, l, q.copy(), dv=dv)


def test_overlapping_outputs(qkv):
    q, k, v = qkv
    with raises(InvalidArgumentError, "out", "overlaps", "q"):
        ops.attention_forward(q, k, v, out=q)
    buf = np.zeros((2, 7, 4, 16))
    with raises(InvalidArgumentError, "out", "overlaps", "k"):
        ops.attention_forward(q, buf[:, :, 2:, 8:], buf[:, :, 2:, 8:], out=buf[..., :8])
    o, l = ops.attention_forward(q, k, v)
    with raises(InvalidArgumentError, "dq", "overlaps", "dout"):
        do = q.copy()
        ops.attention_backward(q, k, v, o, l, do, dq=do)
    with raises(InvalidArgumentError, "dk", "overlaps", "dv"):
        g = np.zeros_like(k)
        ops.attention_backward(q, k, v, o, l, q.copy(), dk=g, dv=g)
    with raises(InvalidArgumentError, "out_acc", "overlaps", "out_part"):
        ops.merge_(o, l, o, l.copy())
    with raises(InvalidArgumentError, "lse", "overlaps", "out"):
        raw = np.zeros(2 * 7 * 4 * 8 + 2 * 4 * 7)
        ops.attention_forward(q, k, v, out=raw[:448].reshape(q.shape), lse=raw[440:496].reshape(2, 4, 7))


def test_broadcast_output_rejected():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 7, 4, 8, dtype=torch.float64)
    out = torch.zeros(1, 7, 4, 8, dtype=torch.float64).expand(2, 7, 4, 8)
    with raises(InvalidArgumentError, "out", "more than once"):
        ops.attention_forward(q, q, q, out=out)


def test_wrong_device_and_non_tensors(qkv):
    q, k, v = qkv
    with raises(TypeError, "k", "__dlpack__", "list"):
        ops.attention_forward(q, [[1.0]], v)

    class OnGpu:
        shape = q.shape

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kw):
            raise AssertionError("must not be exported")

    with raises(UnsupportedError, "v", "cuda:0", "not built"):
        ops.attention_forward(q, k, OnGpu())


def test_wrong_device_torch():
    torch = pytest.importorskip("torch")
    q = torch.empty(1, 3, 1, 8, device="meta")
    with raises(UnsupportedError, "q", "meta", "CPU"):
        ops.attention_forward(q, q, q)


def test_bad_scalars(qkv):
    q, k, v = qkv
    with raises(ValueError, "q_pos0", ">= 0"):
        ops.attention_forward(q, k, v, q_pos0=-1)
    with raises(TypeError, "k_pos0", "int"):
        ops.attention_forward(q, k, v, k_pos0=1.5)
    with raises(ValueError, "scale", "finite"):
        ops.attention_forward(q, k, v, scale=math.nan)


def test_misaligned_data_rejected():
    raw = np.zeros(8 * 2 * 3 * 8 + 1, np.uint8)
    q = raw[1:].view(np.float64).reshape(1, 3, 2, 8)  # NumPy allows unaligned arrays
    with raises(InvalidArgumentError, "q", "aligned"):
        ops.attention_forward(q, q, q)


def test_producer_errors_are_prefixed_with_the_name():
    class Broken:
        shape = (1, 1, 1, 8)

        def __dlpack__(self, **kw):
            raise BufferError("cannot export")

    q = np.zeros((1, 1, 1, 8))
    with raises(BufferError, "v.__dlpack__() failed", "cannot export"):
        ops.attention_forward(q, q, Broken())

    class NotACapsule:
        shape = (1, 1, 1, 8)

        def __dlpack__(self, **kw):
            return 42

    with raises(TypeError, "k.__dlpack__()", "dltensor_versioned", "int"):
        ops.attention_forward(q, NotACapsule(), q)

    class Reused:
        shape = (1, 1, 1, 8)

        def __init__(self):
            self.cap = q.__dlpack__(max_version=(1, 0))

        def __dlpack__(self, **kw):
            return self.cap

    r = Reused()
    ops.attention_forward(q, r, q)
    with raises(TypeError, "k.__dlpack__()", "used_dltensor_versioned", "already consumed"):
        ops.attention_forward(q, r, q)


# ------------------------------------------------------------------------------------------------ CUDA library

@pytest.mark.skipif(not hexiseq.build_info()["cuda"], reason="hexiseq was built without CUDA kernels")
@pytest.mark.parametrize("case", ["float32", "scale"])
def test_cuda_library_refusals_reach_python(case):
    """Refusals the CUDA kernels library makes before it touches a GPU, so host memory labelled kDLCUDA is never
    read and no GPU is needed: one of its own (float32 is not served) and one of the params validation it borrows
    from the extension (the scale). Both texts travel through the extension's error buffer; every import is
    released once."""
    from hexiseq import _core

    rng = np.random.default_rng(12)
    q, k, v = small(rng, dtype=np.float32 if case == "float32" else np.float16)
    out, lse = np.empty_like(q), np.empty((1, 2, 5), np.float32)
    wrapped = [Crafted(a, device=KDLCUDA) for a in (q, k, v, out, lse)]
    scale = -1.0 if case == "scale" else 0.125
    expected = {"float32": (UnsupportedError, "dtype float32", "float16 and bfloat16 only"),
                "scale": (InvalidArgumentError, "scale must be finite and > 0, got -1")}[case]
    with raises(*expected):
        _core.attention_forward_cuda(*wrapped, False, 0, 0, scale, 0)
    assert [w.deleted for w in wrapped] == [1] * 5
