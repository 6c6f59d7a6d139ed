"""Is F.linear (MKL sgemm) row independent on this CPU? For the 0.5b's five projection shapes (random fp32
weights), with 1 and 2 threads: does a 1-row call give bit for bit the first row of a 2..8-row call, and
does a 2-row call give the first two rows of a 3..8-row call? Row independence is what lets a verify
block of 1 + k rows give the logits of k + 1 one-row decodes (fp32 greedy speculation identical to the
baseline) and a seeded request draw the same tokens alone and in a batch (`specserve.model.cpu_linear`).

    python benchmarks/cpu_linear_rows.py
"""

import torch
import torch.nn.functional as F
torch.manual_seed(0)
shapes = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "lm_head": (151936, 896)}
for threads in (1, 2):
    torch.set_num_threads(threads)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k) * 0.02
        x = torch.randn(8, k)
        one = F.linear(x[:1], w)
        bad = [r for r in range(2, 9) if not torch.equal(F.linear(x[:r], w)[:1], one)]
        bad_mid = [r for r in range(2, 9) if not torch.equal(F.linear(x[:r], w)[:2], F.linear(x[:2], w))]
        print(threads, name, "1-row differs from first row at rows:", bad, "| 2-row prefix differs at:", bad_mid)
