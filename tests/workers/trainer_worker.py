"""Run under torchrun by tests/test_trainer.py: HexiSeqTrainer given a plan for 3 devices on 2 ranks; each rank
prints the refusal it gets and exits with status 1."""

import sys
import tempfile

import transformers

import hexiseq
from hexiseq.errors import HexiseqError
from hexiseq.trainer import HexiSeqTrainer

config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=8, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config)
cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 3, "intra_gbps": 450.0}]})
plan = hexiseq.evaluate(cluster, model=hexiseq.Model.from_hf_config(config), seq_len=30, layout={"groups": [
    {"devices": [0, 1, 2], "seq": 30, "tokens": [10, 10, 10], "heads": [3, 3, 2]}]})
with tempfile.TemporaryDirectory() as d:
    args = transformers.TrainingArguments(output_dir=d, max_steps=1, report_to=[], use_cpu=True)
    try:
        HexiSeqTrainer(model=model, args=args, plan=plan, train_dataset=[])
    except HexiseqError as e:
        import torch.distributed as dist
        print(f"rank {dist.get_rank()} refused: {e}", flush=True)
        sys.exit(1)
print("not refused", flush=True)
