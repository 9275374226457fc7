"""Worker processes for tests/test_memory_features.py (imported by spawned children, so it lives in a module)."""

import datetime
import traceback

import torch
import torch.distributed as dist

GIB = 1024 ** 3


def tiny_llama(seed, layers=4):
    """A small randomly initialised Llama in float64 (hidden 32, 4 heads, 2 kv heads), its attention through SDPA
    (PyTorch's CPU SDPA stays in float64)."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=53,
                                   max_position_embeddings=128, initializer_range=0.1, rope_theta=1000.0,
                                   attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).double().train()


class Forced:
    """A plan whose memory features are given (the others are the plan's): the runtime's half tested on what the
    planner chooses only at sizes too long for a CPU test (tiles of 4096 tokens)."""

    def __init__(self, plan, features):
        self._plan, self._features = plan, features

    def memory_features(self, device):
        return self._features.get(device, self._plan.memory_features(device))

    def one_layout(self, where="this call"):  # the plan of one layout is this one, with its forced features
        self._plan.one_layout(where)
        return self

    def __getattr__(self, name):
        return getattr(self._plan, name)


def reference(seed, ids):
    """The unpatched model's loss and gradients on the full sequence, in one process."""
    model = tiny_llama(seed)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="mean")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run(rank, world, init, plan_json, forced, seed, results):
    """Each rank: patch the model with the plan (memory features applied for its device), the loss from the hidden
    states (tiled where chosen), gradients summed over the ranks; rank 0 checks them against the reference."""
    try:
        import hexiseq
        import hexiseq.hf as hf

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        plan = hexiseq.Plan.from_json(plan_json)
        if forced:
            plan = Forced(plan, {int(k): v for k, v in forced.items()})
        torch.manual_seed(seed + 1)
        ids = torch.randint(0, 53, (1, plan.seq_len))
        model = hf.patch_model(tiny_llama(seed), plan)
        chosen = plan.memory_features(rank)
        layers = [m for n, m in model.named_modules() if type(m).__name__ == "LlamaDecoderLayer"]
        report = {"chosen": chosen,
                  "tiled_mlp": [type(m.mlp).__name__ for m in layers],
                  "checkpointing": [bool(m.gradient_checkpointing) for m in layers]}
        if chosen["offload"]:  # as transformers' Trainer does at train(): the plain checkpoint set again, then put back
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            report["reset"] = [m._gradient_checkpointing_func.func.__name__ for m in layers]
            hf.keep_offloading(model)
        hidden = model.model(**hf.shard_inputs(ids, plan, rank)).last_hidden_state
        offloader = getattr(model, "_hexiseq_offloader", None)
        if offloader is not None:
            report["saved"], report["host_bytes"] = offloader.saved, offloader.host_bytes
        loss = hf.sharded_causal_lm_loss_from_hidden(hidden, model.lm_head.weight, ids, plan)
        loss.backward()
        if offloader is not None:
            report["host_bytes_after"] = offloader.host_bytes
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[n.replace(".mlp.mlp.", ".mlp.")] = g
        hf.unpatch_model(model)
        report["restored"] = [type(m.mlp).__name__ for m in layers] + [bool(m.gradient_checkpointing) for m in layers]
        if rank == 0:
            ref_loss, ref_grads = reference(seed, ids)
            report["loss_err"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            report["grad_err"] = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-300)).item()
                                     for n, g in ref_grads.items())
        results.put((rank, "ok", report))
    except Exception:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
