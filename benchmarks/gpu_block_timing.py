# The calibration's attention timing (the device synchronised around every call) next to back-to-back calls and the host's
# time to issue them, through the block backend the runtime chooses, 24/8 heads of dim 128, bf16 (run on a GPU machine).
import math, time, statistics, torch
from hexiseq.runtime import blocks
from hexiseq.planner.calibration import _seconds
dev = torch.device("cuda", 0); dt = torch.bfloat16
h, kv, d = 24, 8, 128
kern = blocks.kernels_for(dev, dt)
print("kernels", type(kern).__name__)
for n in (1024, 2048, 4096, 8192, 16384):
    q = torch.randn(1, n, h, d, device=dev, dtype=dt); k = torch.randn(1, n, kv, d, device=dev, dtype=dt)
    v = torch.randn(1, n, kv, d, device=dev, dtype=dt); do = torch.randn_like(q)
    for q_pos0 in (n, 0):
        o, lse = kern.forward(q, k, v, True, q_pos0, 0, 1 / math.sqrt(d))
        o_acc, lse_acc = o.float(), lse.float().clone()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=dev); dk = torch.zeros(k.shape, dtype=torch.float32, device=dev); dv = torch.zeros_like(dk)
        def fwd():
            o_p, l_p = kern.forward(q, k, v, True, q_pos0, 0, 1 / math.sqrt(d)); kern.merge(o_acc, lse_acc, o_p, l_p)
        def bwd():
            kern.backward_into(q, k, v, o, lse, do, True, q_pos0, 0, 1 / math.sqrt(d), dq, dk, dv)
        pairs = n * n if q_pos0 else n * (n + 1) / 2
        fl = 4.0 * pairs * d * h * 3.5
        t_sync = _seconds(fwd, dev, 5, 2) + _seconds(bwd, dev, 5, 2)
        def b2b(fn, reps=20):
            fn(); torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(reps): fn()
            torch.cuda.synchronize(); return (time.perf_counter() - t0) / reps
        def host(fn, reps=20):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(reps): fn()
            t = (time.perf_counter() - t0) / reps; torch.cuda.synchronize(); return t
        t_b2b = b2b(fwd) + b2b(bwd)
        t_host = host(fwd) + host(bwd)
        print(f"n {n:6d} {'full' if q_pos0 else 'diag'}: synced {fl / t_sync / 1e12:7.1f} TF/s ({t_sync * 1e3:.3f} ms)  back-to-back {fl / t_b2b / 1e12:7.1f} TF/s ({t_b2b * 1e3:.3f} ms)  host issue {t_host * 1e3:.3f} ms", flush=True)
