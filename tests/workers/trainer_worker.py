"""The rank side of tests/test_trainer.py's refusal (imported by forked ranks, so it lives in a module):
HexiSeqTrainer given a plan for 3 devices on 2 ranks; each rank reports the refusal it gets."""

import os
import tempfile
import traceback

import torch


def refuse_a_plan_of_another_size(rank, world, init, port, results):
    """HexiSeqTrainer built on `world` ranks (torchrun's environment, as accelerate reads it) with a plan for 3
    devices. Reports (rank, "refused", message) or (rank, "not refused", None), or (rank, "error", traceback)."""
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
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
                out = ("not refused", None)
            except HexiseqError as e:
                out = ("refused", f"rank {torch.distributed.get_rank()} refused: {e}")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        results.put((rank, *out))
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
