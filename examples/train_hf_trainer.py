"""Train a tiny Hugging Face Llama with the transformers Trainer and HexiSeq attention, and check it against a plain
Trainer in one process.

    torchrun --nproc_per_node 3 examples/train_hf_trainer.py --steps 4

Every rank builds the same model and dataset; `hexiseq.trainer.HexiSeqTrainer` (the only change from a plain
Trainer script: the class and its `plan=`) patches the model, gives every rank the same batches, feeds each rank
its shard of the tokens and makes the loss and gradient those of the whole sequences. The plan is an asymmetric
one, made for a mixed cluster (an H100 node of 2 and an A100): unequal token shares and head counts on the ranks.
Rank 0 then runs a plain `transformers.Trainer` on the same data in a process of its own (no torchrun environment)
and compares every step's loss, the trained weights and the evaluation loss on a held-out set; the script exits
with status 1 if they differ by more than --tolerance (relative; the weights 10x that).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers
from torch.utils.data import RandomSampler

import hexiseq

VOCAB = 97


def build_model(dtype, seed):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype)


def build_dataset(n, seq_len, seed):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (n, seq_len), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def arguments(args, out_dir):
    return transformers.TrainingArguments(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.lr,
        logging_steps=1, report_to=[], save_strategy="no", seed=args.seed, use_cpu=True, disable_tqdm=True,
        dataloader_drop_last=True, lr_scheduler_type="constant", optim=args.optim)


class Recording:
    """Records every training step's loss at full precision (the Trainer's logs round it)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
        if model.training:
            self.losses = getattr(self, "losses", []) + [float((loss[0] if return_outputs else loss).detach())]
        return loss


class WholeSequenceLoss(transformers.Trainer):
    """The next-token loss as hexiseq.hf.sharded_causal_lm_loss defines it (the model's own formula, but in float64
    for a float64 model: transformers' loss casts the logits to float32, which would cap the comparison at 1e-7)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(input_ids=inputs["input_ids"])
        logits, labels = out.logits[:, :-1], inputs["labels"][:, 1:]
        acc = torch.promote_types(logits.dtype, torch.float32)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(acc), labels.reshape(-1),
                                                 ignore_index=-100)
        return (loss, out) if return_outputs else loss


class PlainTrainer(Recording, WholeSequenceLoss):
    def _get_train_sampler(self, train_dataset=None):
        # the order HexiSeqTrainer reads the batches in (a sampler seeded with args.seed), so the runs compare
        return RandomSampler(train_dataset or self.train_dataset, generator=torch.Generator().manual_seed(self.args.seed))


def reference(args):
    """A plain Trainer in this one process: every step's loss and the trained weights, to args.out."""
    model = build_model(getattr(torch, args.dtype), args.seed)
    with tempfile.TemporaryDirectory() as d:
        t = PlainTrainer(model=model, args=arguments(args, d), train_dataset=build_dataset(64, args.seq_len, args.seed),
                         eval_dataset=build_dataset(6, args.seq_len, args.seed + 7))
        t.train()
        evaluated = t.evaluate()["eval_loss"]
    torch.save({"losses": t.losses, "state": model.state_dict(), "eval_loss": evaluated}, args.out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=61)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--optim", default="adamw_torch", help="the Trainer's optimizer (sgd: the weights then follow the "
                    "gradients linearly; Adam turns rounding-level differences of near-zero gradients into whole steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=None, help="default 1e-5 (float32), 1e-9 (float64)")
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference:
        return reference(args)
    tolerance = args.tolerance or (1e-5 if args.dtype == "float32" else 1e-9)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 3:
        sys.exit("run with 3 processes: torchrun --nproc_per_node 3 examples/train_hf_trainer.py")

    from hexiseq.trainer import HexiSeqTrainer

    class Trainer(Recording, HexiSeqTrainer):
        pass

    model = build_model(getattr(torch, args.dtype), args.seed)
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 300.0},
                                                   {"gpu": "A100-80G", "count": 1, "intra_gbps": 300.0}],
                                         "inter_node_gbps": 25.0})
    # a layout given by hand (a model this small would be planned on one device): the H100s share the heads of a
    # group of 40 tokens (22 + 18 tokens, 3 + 5 of the 8 heads: kv head 0 split between them), the A100 is a group
    # of its own in the ring; -3 .. +3 tokens around --seq-len's 61 keep the same shape
    S = args.seq_len
    g0 = (S * 2) // 3
    plan = hexiseq.evaluate(cluster, model=hexiseq.Model.from_hf_config(model.config), seq_len=S, layout={"groups": [
        {"devices": [0, 1], "seq": g0, "tokens": [g0 - g0 // 2 + 2, g0 // 2 - 2], "heads": [3, 5]},
        {"devices": [2], "seq": S - g0, "tokens": [S - g0], "heads": [8]}]})
    rows = [plan.device_row(r) for r in range(world)]
    if any(row["tokens"] == 0 for row in rows):
        sys.exit(f"--seq-len {S} leaves a rank without tokens in this example's layout: give 9 or more")
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(model=model, args=arguments(args, d), plan=plan,
                          train_dataset=build_dataset(64, args.seq_len, args.seed),
                          eval_dataset=build_dataset(6, args.seq_len, args.seed + 7))
        rank = torch.distributed.get_rank()
        if rank == 0:
            print(plan.explain().splitlines()[0])
            print("\n".join(plan.explain().splitlines()[-3:]))
            print(f"tokens per rank {[row['tokens'] for row in rows]}, query heads per rank "
                  f"{[row['head_count'] for row in rows]}: every rank holds tokens")
        trainer.train()
        evaluated = trainer.evaluate()["eval_loss"]
    # Every rank, before it returns: without this the world group (which accelerate made) would live until the
    # interpreter shuts down, with Gloo threads that must not outlive it (the model's HexiSeq context lets go of its
    # groups in hexiseq's exit hook).
    torch.distributed.destroy_process_group()
    if rank != 0:
        return
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "reference.pt")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                                "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                                                                "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
        subprocess.run([sys.executable, __file__, "--reference", "--out", out, "--steps", str(args.steps),
                        "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                        "--dtype", args.dtype, "--seed", str(args.seed), "--optim", args.optim], env=env, check=True)
        ref = torch.load(out)
    worst = 0.0
    for step, (a, b) in enumerate(zip(trainer.losses, ref["losses"])):
        diff = abs(a - b) / abs(b)
        worst = max(worst, diff)
        print(f"step {step}: HexiSeqTrainer {a!r}  plain Trainer {b!r}  relative difference {diff:.2e}")
    drift = max(float((p - ref["state"][k]).abs().max() / ref["state"][k].abs().max().clamp_min(1e-30))
                for k, p in model.state_dict().items())
    print(f"trained weights: max relative difference to the plain Trainer's {drift:.2e}")
    eval_diff = abs(evaluated - ref["eval_loss"]) / abs(ref["eval_loss"])
    print(f"evaluation loss: HexiSeqTrainer {evaluated!r}  plain Trainer {ref['eval_loss']!r}  relative difference "
          f"{eval_diff:.2e}")
    ok = len(trainer.losses) == len(ref["losses"]) == args.steps and worst <= tolerance and drift <= tolerance * 10 \
        and eval_diff <= tolerance
    print(f"max relative loss difference {worst:.2e} ({'OK' if ok else 'FAILED'}: tolerance {tolerance:g})")
    print(json.dumps({"losses": trainer.losses, "reference": ref["losses"], "weights_drift": drift}))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
