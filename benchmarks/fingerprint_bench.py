"""What the divergence vote, the gradient audit and the checkpoint certificate cost: a training
step with and without each, side by side in one process ([Note: exact fingerprints] in
recover_hsdp/recovery/fingerprint.py, [Note: divergence votes] in manager/divergence.py,
[Note: gradient audits] in manager/audits.py).

One process builds TorchTitan's Llama 3 (``recover_llama3``, a flavor given by ``--flavors``),
then times, in interleaved pairs on the same model, optimizer and data:

  without   forward + backward of ``--microbatches`` microbatches + AdamW step (the step's work);
  with      the same, then ``parameter_fingerprint`` (what every voting step adds per rank: the
            vote itself rides in the totals all-reduce the step makes anyway);
  audit     the same as without, then what an audit step adds on a replica that is audited and
            audits another: 2 more forward + backward of one microbatch, each gradient's
            statistics (sum, sum of |g|, sum of g^2 in float64) taken and the gradient dropped
            (in a job the FSDP hook takes them from the bucket; here ``autograd.grad``);

and, separately, the fingerprint alone and ``state_fingerprint`` (parameters + optimizer state:
what a checkpoint's certificate adds per save). The ratio with / without is the per-step cost
at ``consistency_check_interval = 1`` on this machine; the fingerprint is one read of the shard
(memory-bound), the step is compute-bound, so on a GPU the ratio depends on HBM bandwidth vs
FLOPs and only a GPU run can give it (the script runs there unchanged with ``--device cuda``).

Writes benchmarks/results/fingerprint.json and prints a table. ~3 min with the defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from _common import RESULTS, machine
from recover_hsdp.recovery.fingerprint import parameter_fingerprint, state_fingerprint  # noqa: E402
from recover_hsdp.titan import cpu_runtime, model_spec  # noqa: E402


def build(flavor: str, seq_len: int, device: str):
    cpu_runtime.install()
    model_spec.register()
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(model_spec.TRAIN_SPEC_NAME)
    args = spec.model_args[flavor]
    args.max_seq_len = seq_len
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, args.vocab_size


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def measure(flavor: str, pairs: int, microbatches: int, batch: int, seq_len: int,
            device: str) -> dict:
    model, optimizer, vocab = build(flavor, seq_len, device)
    data = torch.randint(0, vocab, (microbatches, batch, seq_len + 1), device=device)

    def step():
        for tokens in data:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     tokens[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step_and_vote():
        step()
        parameter_fingerprint(model)

    params_list = [p for p in model.parameters() if p.requires_grad]

    def step_and_audit():
        step()
        for _ in range(2):  # the replica's own audited microbatch again, the one it audits
            tokens = data[0]
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     tokens[:, 1:].flatten())
            grads = torch.autograd.grad(loss, params_list)
            torch.stack([torch.stack([g.sum(dtype=torch.float64),
                                      torch.linalg.vector_norm(g, 1, dtype=torch.float64),
                                      torch.linalg.vector_norm(g, 2, dtype=torch.float64).square()])
                         for g in grads]).sum(dim=0).tolist()

    for _ in range(2):  # warm-up: optimizer state, allocator
        step_and_vote()
        step_and_audit()
    without, with_vote, with_audit, alone, state = [], [], [], [], []
    sides = [(step, without), (step_and_vote, with_vote), (step_and_audit, with_audit)]
    for index in range(pairs):  # interleaved, the order rotating: drift hits every side
        for fn, times in sides[index % 3:] + sides[:index % 3]:
            times.append(timed(fn, device))
        alone.append(timed(lambda: parameter_fingerprint(model), device))
        state.append(timed(lambda: state_fingerprint(model, [optimizer]), device))
    params = sum(p.numel() for p in model.parameters())
    ratios = [w / o for w, o in zip(with_vote, without)]
    audit_ratios = [w / o for w, o in zip(with_audit, without)]
    return {
        "flavor": flavor, "params": params, "pairs": pairs, "microbatches": microbatches,
        "batch": batch, "seq_len": seq_len, "device": device,
        "step_s": statistics.median(without), "step_with_vote_s": statistics.median(with_vote),
        "ratio_with_over_without": statistics.median(ratios),
        "step_with_audit_s": statistics.median(with_audit),
        "audit_ratio_over_without": statistics.median(audit_ratios),
        "fingerprint_s": statistics.median(alone),
        "fingerprint_over_step": statistics.median(alone) / statistics.median(without),
        "state_fingerprint_s": statistics.median(state),
        "fingerprint_gb_per_s": params * 4 / statistics.median(alone) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", default="debugmodel")
    parser.add_argument("--shapes", default="1x2x128,4x2x512",
                        help="steps to time, each G x local batch x seq_len")
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(RESULTS / "fingerprint.json"))
    args = parser.parse_args()
    rows = []
    for flavor in args.flavors.split(","):
        for shape in args.shapes.split(","):
            g, batch, seq_len = (int(x) for x in shape.split("x"))
            rows.append(measure(flavor, args.pairs, g, batch, seq_len, args.device))
            row = rows[-1]
            print(f"{flavor:>10} {row['params'] / 1e6:6.1f}M params G={g} {batch}x{seq_len}: "
                  f"step {row['step_s']:.4f}s, with the vote {row['step_with_vote_s']:.4f}s "
                  f"(ratio {row['ratio_with_over_without']:.4f}); fingerprint "
                  f"{row['fingerprint_s'] * 1e3:.2f} ms = {row['fingerprint_over_step']:.2%} of "
                  f"the step ({row['fingerprint_gb_per_s']:.1f} GB/s); state fingerprint "
                  f"{row['state_fingerprint_s'] * 1e3:.2f} ms; with an audit "
                  f"{row['step_with_audit_s']:.4f}s (ratio "
                  f"{row['audit_ratio_over_without']:.3f})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "rows": rows,
                               "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                              indent=2))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
