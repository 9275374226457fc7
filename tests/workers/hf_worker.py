"""Worker processes for tests/test_hf.py (imported by spawned children, so it lives in a module)."""

import copy
import datetime
import traceback

import torch
import torch.distributed as dist


def tiny_model(family, seed, attn="sdpa"):
    """A small randomly initialised causal LM in float64: hidden 64, 2 layers, 8 heads, 2 kv heads (GQA 4:1).

    The reference runs attn_implementation="sdpa", not "eager": transformers' eager attention takes the softmax in
    float32 even for a float64 model (eager_attention_forward: softmax(..., dtype=torch.float32)), which moves the
    loss by ~1e-10 relative; PyTorch's CPU SDPA stays in float64."""
    import transformers

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=97, max_position_embeddings=128, initializer_range=0.1,
                  rope_theta=1000.0, attn_implementation=attn, use_cache=False)
    if family == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif family == "mistral":   # sliding_window 4096 > seq_len: plain causal attention
        cfg, cls = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    elif family == "qwen2":     # biases on q/k/v
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif family == "mistral-window":  # a 9-token window on every layer
        cfg, cls = transformers.MistralConfig(**common, sliding_window=9), transformers.MistralForCausalLM
    elif family == "gemma3":    # a sliding layer and a global one
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=9, head_dim=8, query_pre_attn_scalar=8,
                                            layer_types=["sliding_attention", "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    elif family == "gemma2":    # soft-capped logits, a sliding layer and a global one (eager only in transformers)
        common["attn_implementation"] = "eager" if attn == "sdpa" else attn
        cfg = transformers.Gemma2Config(**common, sliding_window=9, attn_logit_softcapping=5.0, head_dim=8,
                                        query_pre_attn_scalar=8, final_logit_softcapping=None)
        cls = transformers.Gemma2ForCausalLM
    elif family == "gpt_oss":   # sink logits, a sliding layer and a global one, 4 experts (eager only in transformers)
        common["attn_implementation"] = "eager" if attn == "sdpa" else attn
        cfg = transformers.GptOssConfig(**common, sliding_window=9, head_dim=8, num_local_experts=4,
                                        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
        cls = transformers.GptOssForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    if family == "gpt_oss":  # its experts' grouped matmul takes no float64
        return cls(cfg).float()
    return cls(cfg).double()


def _rel(a, b):
    """Largest error relative to the largest reference value (exact zeros must stay zeros); inf for tensors of
    different shapes, 0 for two empty ones (a parked rank's shard)."""
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def _raises(fn, cls, needle):
    try:
        fn()
    except cls as e:
        return needle in str(e) or f"wrong message: {e}"
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {e}"
    return "did not raise"


def check_models(rank, world, init, plan_json, families, batch, errors, results):
    """check_model for each family in turn (one process group: starting the processes dominates the time).
    Reports (rank, "ok", {family: metrics}) or (rank, "error", traceback)."""
    try:
        torch.set_num_threads(1)   # several processes share the machine's cores
        import hexiseq

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        plan = hexiseq.Plan.from_json(plan_json)
        out = {family: check_model(rank, plan, family, batch, check_errors=(errors and i == 0))
               for i, family in enumerate(families)}
        results.put((rank, "ok", out))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def _grad_errors(model, ref_grads):
    """(largest relative error of a parameter's gradient summed over the ranks against ref_grads, that parameter's
    name, the parameters without a gradient). Collective: one all_reduce per parameter that has a gradient."""
    worst, worst_name, missing = 0.0, None, []
    for n, p in model.named_parameters():
        if p.grad is None:
            missing.append(n)
            continue
        gsum = p.grad.detach().clone()
        dist.all_reduce(gsum)
        e = _rel(gsum, ref_grads[n])
        if e > worst:
            worst, worst_name = e, n
    return worst, worst_name, missing


def check_model(rank, plan, family, batch, check_errors):
    """Reference: the unpatched model on the full sequence (float64 loss with transformers' formula, and
    transformers' own .loss). Distributed: the patched model on this rank's shard, sharded_causal_lm_loss,
    gradients summed over the ranks. Returns {metric: value}."""
    import torch.nn.functional as F

    import hexiseq
    from hexiseq.hf import patch_model, shard_inputs, sharded_causal_lm_loss, unpatch_model

    S = plan.seq_len
    ref_model = tiny_model(family, seed=1234)
    model = copy.deepcopy(ref_model)
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, ref_model.config.vocab_size, (batch, S), generator=g)
    m = {}

    # reference, single process, full sequence
    out = ref_model(input_ids=ids, labels=ids)
    V = out.logits.shape[-1]
    ref_loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))   # float64
    ref_loss.backward()
    m["hf_loss_vs_ref64"] = abs(out.loss.item() - ref_loss.item()) / abs(ref_loss.item())
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}
    ref_logits = out.logits.detach()

    # distributed
    if family == "qwen2":   # recomputation in backward repeats the forward's collectives, in the same order
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    m["checkpointing"] = bool(getattr(model, "is_gradient_checkpointing", False))
    patch_model(model, plan)
    m["attn_impl"] = model.config._attn_implementation
    dout = model(**shard_inputs(ids, plan, rank))
    loss = sharded_causal_lm_loss(dout.logits, ids, plan, rank)
    loss.backward()
    m["logits"] = _rel(dout.logits.detach(), plan.shard(ref_logits, 1, rank))   # 0 tokens on a parked rank
    m["loss_vs_ref64"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    m["loss_vs_hf"] = abs(loss.item() - out.loss.item()) / abs(out.loss.item())
    m["loss_dtype"] = str(loss.dtype)
    m["grad"], m["grad_worst_param"], m["grad_missing"] = _grad_errors(model, ref_grads)
    m["n_params"] = sum(1 for _ in model.parameters())

    m.update(check_packed(rank, plan, model, ref_model, batch))

    if check_errors:
        # without shard_inputs' all-ones mask (transformers then looks for packed sequences in position_ids): the
        # same logits
        sh = shard_inputs(ids, plan, rank)
        with torch.no_grad():
            o2 = model(input_ids=sh["input_ids"], position_ids=sh["position_ids"])
        m["no_mask_logits"] = _rel(o2.logits, plan.shard(ref_logits, 1, rank))
        # every check below raises before any communication, on every rank alike
        mask = torch.ones_like(sh["input_ids"])
        mask[0, 0] = 0
        m["err_padding"] = _raises(lambda: model(**{**sh, "attention_mask": mask}), hexiseq.errors.UnsupportedError,
                                   "padding attention_mask")
        m["err_positions"] = _raises(lambda: model(input_ids=sh["input_ids"], position_ids=sh["position_ids"] + 1),
                                     hexiseq.InvalidArgumentError, "position_ids")
        other = hexiseq.plan(plan.cluster, model=hexiseq.Model(layers=2, hidden=64, heads=8, kv_heads=4,
                                                                head_dim=8, ffn=128, vocab=97),
                             seq_len=S, strategy="ring")
        m["err_heads"] = _raises(lambda: patch_model(copy.deepcopy(ref_model), other),
                                 hexiseq.InvalidArgumentError, "num_key_value_heads=2")
        # unpatch: back to sdpa, full sequence, same logits as the reference
        unpatch_model(model)
        m["unpatched_impl"] = model.config._attn_implementation
        with torch.no_grad():
            m["unpatched_logits"] = _rel(model(input_ids=ids).logits, ref_logits)
    return m


# Packed documents per batch row of the 61-token sequences: one of one token, documents across the groups' chunks
PACKED = ([1, 17, 25, 3, 15], [30, 31])


def check_packed(rank, plan, model, ref_model, batch):
    """Packed documents as transformers' DataCollatorWithFlattening gives them (position_ids restarting at each
    document, labels -100 at each document's first token), through shard_inputs(..., position_ids=) on the patched
    model, against the unpatched model run document by document (so nothing crosses a boundary by construction):
    logits, loss and the gradients summed over the ranks. `model` is patched; both models' gradients are reset."""
    import torch.nn.functional as F

    from hexiseq.hf import shard_inputs, sharded_causal_lm_loss

    S = plan.seq_len
    rows = PACKED[:batch]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, ref_model.config.vocab_size, (batch, S), generator=g)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    labels = ids.clone()
    for b, r in enumerate(rows):
        labels[b, torch.cumsum(torch.tensor([0] + r[:-1]), 0)] = -100   # no token predicts a document's first
    m = {}
    for mod in (model, ref_model):
        mod.zero_grad(set_to_none=True)

    # reference: each document alone through the unpatched model, the loss over the pairs inside documents
    logits, total, count = [], 0.0, 0
    for b, r in enumerate(rows):
        row, at = [], 0
        for n in r:
            out = ref_model(input_ids=ids[b:b + 1, at:at + n], position_ids=torch.arange(n)[None]).logits
            row.append(out)
            if n > 1:
                total = total + F.cross_entropy(out[0, :-1], ids[b, at + 1:at + n], reduction="sum")
                count += n - 1
            at += n
        logits.append(torch.cat(row, 1))
    ref_logits = torch.cat(logits, 0).detach()
    ref_loss = total / count
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}
    # transformers' own packed handling on the full sequence (float32 loss): the reference means the same thing
    with torch.no_grad():
        hf = ref_model(input_ids=ids, position_ids=position_ids, labels=labels)
    m["packed_hf_loss_vs_ref"] = abs(hf.loss.item() - ref_loss.item()) / abs(ref_loss.item())

    inputs = shard_inputs(ids, plan, rank, position_ids=position_ids)
    m["packed_documents"] = inputs.get("hexiseq_documents")
    dout = model(**inputs)
    loss = sharded_causal_lm_loss(dout.logits, labels, plan, rank)
    loss.backward()
    m["packed_logits"] = _rel(dout.logits.detach(), plan.shard(ref_logits, 1, rank))
    m["packed_loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    m["packed_grad"], _, m["packed_grad_missing"] = _grad_errors(model, ref_grads)
    return m


def check_own_config(rank, world, init, plan_json, results):
    """patch_model on a model built from a config object the caller keeps, then, from that same object, a reference
    model and an AutoModelForCausalLM: they must run plainly (sdpa, the caller's use_cache). The patched model is fed
    the plan's own shards (plan.shard and plan.positions, as patch_model's docstring writes it: 0 tokens on a parked
    rank) and its loss, from the logits and from the decoder's hidden states, and its gradients summed over the
    ranks are compared with the reference on the full sequence. Reports (rank, "ok", {metric: value})."""
    try:
        torch.set_num_threads(1)
        import torch.nn.functional as F
        import transformers

        import hexiseq
        from hexiseq.hf import (patch_model, shard_inputs, sharded_causal_lm_loss,
                                sharded_causal_lm_loss_from_hidden, unpatch_model)

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        plan = hexiseq.Plan.from_json(plan_json)
        cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                       num_key_value_heads=2, intermediate_size=128, vocab_size=97,
                                       max_position_embeddings=128, initializer_range=0.1, rope_theta=1000.0,
                                       attn_implementation="sdpa", use_cache=True)
        torch.manual_seed(21)
        model = transformers.LlamaForCausalLM(cfg).double()
        patch_model(model, plan)
        m = {"cfg": (cfg._attn_implementation, cfg.use_cache),
             "patched": (model.config._attn_implementation, model.config.use_cache),
             "modules_share_copy": all(getattr(mod, "config", model.config) is model.config
                                       for mod in model.modules())}
        torch.manual_seed(21)
        ref = transformers.LlamaForCausalLM(cfg).double()   # the same weights, built after the patch
        auto = transformers.AutoModelForCausalLM.from_config(cfg).double()
        ids = torch.randint(0, cfg.vocab_size, (1, plan.seq_len), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            auto(input_ids=ids)
        m["fresh"] = (ref.config._attn_implementation, auto.config._attn_implementation)
        out = ref(input_ids=ids)
        ref_loss = F.cross_entropy(out.logits[0, :-1], ids[0, 1:])
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}

        pos = torch.as_tensor(plan.positions(rank)).unsqueeze(0)
        mine = plan.shard(ids, 1, rank)
        m["tokens"] = mine.shape[1]
        m["shard_inputs"] = [list(t.shape) for t in shard_inputs(ids, plan, rank).values()]
        logits = model(input_ids=mine, position_ids=pos).logits
        loss = sharded_causal_lm_loss(logits, ids, plan, rank)
        loss.backward()
        m["logits"] = _rel(logits.detach(), plan.shard(out.logits.detach(), 1, rank))
        m["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        m["grad"], m["grad_worst_param"], m["grad_missing"] = _grad_errors(model, ref_grads)

        model.zero_grad(set_to_none=True)
        hidden = model.model(input_ids=mine, position_ids=pos).last_hidden_state
        m["hidden_shape"] = list(hidden.shape)
        loss = sharded_causal_lm_loss_from_hidden(hidden, model.lm_head.weight, ids, plan, rank)
        loss.backward()
        m["hidden_loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        m["hidden_grad"], _, m["hidden_grad_missing"] = _grad_errors(model, ref_grads)

        unpatch_model(model)
        m["unpatched"] = (model.config._attn_implementation, model.config.use_cache, cfg._attn_implementation,
                          cfg.use_cache)
        with torch.no_grad():
            m["unpatched_logits"] = _rel(model(input_ids=ids).logits, out.logits.detach())
        results.put((rank, "ok", m))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def check_refusals(rank, world, init, plan_json, results):
    """Inputs the patched model refuses on ONE rank only (a padding mask, position_ids, the token count), one
    scenario after another in the same process group (timeout 5 s), then a good call: reports {scenario: (the
    exception's class, its message, seconds)} so the test can check that every rank raised the same error at
    once and that the ranks are still in step."""
    import time

    try:
        torch.set_num_threads(1)
        import hexiseq
        from hexiseq.hf import patch_model, shard_inputs, sharded_causal_lm_loss

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=5))
        plan = hexiseq.Plan.from_json(plan_json)
        model = patch_model(tiny_model("llama", seed=5), plan)
        ids = torch.randint(0, model.config.vocab_size, (1, plan.seq_len), generator=torch.Generator().manual_seed(3))
        sh = shard_inputs(ids, plan, rank)
        report = {}

        def call(name, fn):
            t0 = time.monotonic()
            try:
                fn()
                report[name] = ("ok", "", time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001  (the test asserts on the class)
                report[name] = (type(e).__name__, str(e), time.monotonic() - t0)

        def scenario(name, **change):
            def run():
                with torch.no_grad():
                    model(**{**sh, **change})
            call(name, run)

        padded = torch.ones_like(sh["input_ids"])
        padded[0, 3] = 0
        scenario("good")
        scenario("padding", **({"attention_mask": padded} if rank == 1 else {}))
        scenario("positions", **({"position_ids": sh["position_ids"] + 1} if rank == 2 else {}))
        scenario("tokens", **({"input_ids": ids, "attention_mask": None, "position_ids": None} if rank == 0 else {}))
        # the inputs and the loss: shard_inputs and sharded_causal_lm_loss agree before anything collective
        logits = torch.zeros(1, sh["input_ids"].shape[1], model.config.vocab_size)
        call("loss_good", lambda: sharded_causal_lm_loss(logits, ids, plan, rank))
        call("loss_labels", lambda: sharded_causal_lm_loss(logits, ids[:, :-1] if rank == 1 else ids, plan, rank))
        call("loss_ignore_index", lambda: sharded_causal_lm_loss(logits, ids, plan, rank,
                                                                 ignore_index=-1 if rank == 2 else -100))
        pos = torch.arange(plan.seq_len).unsqueeze(0)
        call("shard_position_ids", lambda: shard_inputs(ids, plan, rank, position_ids=pos.float() if rank == 0 else pos))
        call("shard_batch", lambda: shard_inputs(ids.repeat(2, 1) if rank == 2 else ids, plan, rank))
        scenario("good_after")
        results.put((rank, "ok", report))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
