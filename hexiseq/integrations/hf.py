"""Run a Hugging Face `transformers` causal LM with HexiSeq attention over torch.distributed.

`patch_model(model, plan)` registers an attention implementation named "hexiseq" in transformers'
`AttentionInterface` (`ALL_ATTENTION_FUNCTIONS`) and a matching no-op entry in `ALL_MASK_ATTENTION_FUNCTIONS`, builds
one `hexiseq.nn.HexiSeqContext` for the model (collective: every rank of the group calls it), attaches it to every
attention module and switches the model to `attn_implementation="hexiseq"`. From then on each attention module
projects Q/K/V and applies RoPE on this rank's token shard as usual, and its attention call goes to
`hexiseq.nn.hexiseq_attn_func`, which exchanges what it needs with the other ranks (all-to-all in the head-parallel
group, ring across groups) and returns the output for the same tokens. Everything outside attention (embeddings,
MLPs, norms, the LM head) is token-local and runs unchanged on the shard.

Every rank feeds its shard of the sequence and the absolute positions of those tokens, so that RoPE rotates each
token by its position in the full sequence (the shard is not contiguous: a group holds a front and a mirrored back
chunk)::

    import torch.distributed as dist
    import hexiseq
    from hexiseq.hf import patch_model, shard_inputs, sharded_causal_lm_loss

    dist.init_process_group("nccl")                       # rank r = cluster device r of the plan
    rank = dist.get_rank()
    plan = hexiseq.plan(cluster, model=hexiseq.Model.from_hf_config(model.config), seq_len=input_ids.shape[1])
    model = patch_model(model, plan)                      # collective
    batch = shard_inputs(input_ids, plan, rank)           # {"input_ids": shard, "position_ids": plan.positions(rank)}
    logits = model(**batch).logits                        # [batch, s_r, vocab]: this rank's tokens only
    loss = sharded_causal_lm_loss(logits, input_ids, plan, rank)   # = model(input_ids, labels=input_ids).loss
    loss.backward()
    for p in model.parameters():                          # each rank's gradients cover its own tokens:
        dist.all_reduce(p.grad)                           # SUM them (under DDP, which averages, use loss * world)

Packed documents (several documents in one sequence, as transformers' `DataCollatorWithFlattening` builds a
batch: position_ids restarting at 0 at each document, labels -100 at each document's first token) run with a
document mask: give shard_inputs the FULL sequence's position_ids, and the loss the collator's labels. Every rank
reads the same documents from the same full position_ids (a document starts wherever a position id is not its
predecessor's plus one), gets its shard of those position_ids for RoPE, and the patched attention lets each query
see only its own document (the ranks check that they agree on the documents)::

    batch = collator(features)                            # input_ids, labels, position_ids: [1, seq_len]
    inputs = shard_inputs(batch["input_ids"], plan, rank, position_ids=batch["position_ids"])
    logits = model(**inputs).logits                       # inputs["hexiseq_documents"]: the documents' lengths
    loss = sharded_causal_lm_loss(logits, batch["labels"], plan, rank)   # no token predicts across a boundary

Without position_ids, shard_inputs gives absolute positions and the whole sequence is one causal document. The
patched attention refuses position_ids that do not fit its call: other than the absolute positions without
documents, not restarting at each document with them. Like every input check of this adapter, the refusal goes
through the call's agreement (hexiseq.runtime.comm.agree): every rank raises the same error at once, naming the
rank, the field and the value, instead of one rank raising while the others wait until the group's timeout.

Batches of unequal sequences (hexiseq.BatchPlanner, hexiseq.nn.BatchContext): patch the model with the job's
BatchContext instead of a plan, and feed each pass of a step inside `with pass_:`::

    context = hexiseq.nn.BatchContext(planner)           # once per job, on every rank
    model = patch_model(model, context)
    step = context.step(planner.plan(lengths, exact=False))   # every step
    for p in step.passes:                                # this rank's group's passes
        with p:
            logits = model(**p.hf_inputs(token_ids)).logits
            loss = F.cross_entropy(logits[0], p.labels(token_ids)[0], reduction="sum") / step.labelled_tokens()
            loss.backward()
    # then every rank's gradients summed, as for one plan

A rank the plan parks (no tokens: the scheduler leaves a slow device out of a short sequence) runs the same loop on
its empty shard: plan.shard, plan.positions and shard_inputs give it 0 tokens, the patched model returns logits
[batch, 0, vocab] for them, and the loss helpers take those. transformers' modules cannot run an empty sequence (an
attention module reshapes with -1, which 0 elements leave ambiguous), so the patched model runs an empty shard as one
placeholder token, whose attention output is 0 and whose outputs it drops: the rank's attention layers take part in
every collective, forward and backward.

Tested with transformers 5.23.0 on LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (float64, CPU, Gloo),
with and without a parked rank, with and without packed documents.
Other models whose attention modules call `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`
with the Llama signature and scale by `module.scaling` should work the same way.

Not supported (each raises a HexiseqError rather than computing something else; where one rank's inputs ask for
it, every rank raises the same error together, through the attention call's agreement): padding masks that are not all
ones and custom 4-D masks (HexiSeq applies the causal mask by absolute position itself, document-causal for packed
documents; pack or trim instead),
KV caches / generation (`patch_model` sets `use_cache = False` in the model's own copy of its config), attention
dropout, and `output_attentions` (the weights are returned as None). Sliding windows (per layer: Mistral, Gemma 2 and
3, gpt-oss), logit soft-capping (Gemma 2) and sink logits (gpt-oss) run as the model asks, each call with the variant
transformers passes it.

transformers is imported lazily: this module imports without it.
"""

import copy
import functools
import math

import torch
import torch.distributed as dist

from ..errors import HexiseqError, InvalidArgumentError, UnsupportedError
from ..runtime.comm import resolve_group
from ..runtime.documents import DOCUMENTS_KWARG

__all__ = ["patch_model", "unpatch_model", "shard_inputs", "sharded_causal_lm_loss", "sharded_causal_lm_loss_from_hidden",
           "keep_offloading", "documents_from_position_ids", "ATTN_IMPLEMENTATION", "DOCUMENTS_KWARG"]

ATTN_IMPLEMENTATION = "hexiseq"
# DOCUMENTS_KWARG (imported above, with the runtime's documents, whose batch passes set it too): the model keyword
# that carries the packed documents' lengths; transformers hands a model's extra keywords to every attention call.

_CTX = "_hexiseq_context"
_CHECK_POS = "_hexiseq_check_positions"
_RUN = "_hexiseq_run"   # {"placeholder": bool}, shared by the decoder stack's hooks and the attention modules


def _transformers():
    try:
        import transformers  # noqa: F401
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as e:
        raise UnsupportedError("hexiseq.hf needs transformers with AttentionInterface and masking_utils "
                               "(pip install 'transformers>=5.23'): " + str(e)) from e
    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


# ------------------------------------------------------------------------------------------ dispatch targets

class _RefusedMask:
    """What the "hexiseq" mask creation returns for a mask HexiSeq cannot apply: it travels to every attention
    call as the attention mask, and the first one refuses it through the call's agreement, so that every rank
    raises together instead of this rank raising in the mask creation while the others wait in their first
    attention call until the group's timeout."""

    def __init__(self, error):
        self.error = error


def _hexiseq_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask 'creation' for attn_implementation="hexiseq": there is no mask to build (HexiSeq masks causally by
    absolute position inside the kernels); a 2-D padding mask is accepted only when it masks nothing. Any other
    is not refused here but handed to the attention calls (_RefusedMask), which refuse it on every rank alike."""
    if attention_mask is None:
        return None
    if not torch.is_tensor(attention_mask):
        return _RefusedMask(UnsupportedError(f"hexiseq: attention_mask must be a tensor of ones or None, got "
                                             f"{type(attention_mask).__name__}"))
    zeros = attention_mask == 0
    if bool(zeros.any()):
        first = [int(i) for i in torch.nonzero(zeros)[0]]
        return _RefusedMask(UnsupportedError(
            f"hexiseq: a padding attention_mask is not supported: attention_mask {list(attention_mask.shape)} has "
            f"{int(zeros.sum())} zero(s), the first at {first} (HexiSeq applies the causal mask by absolute "
            "position itself); pass attention_mask=None or all ones, and pack or trim the sequence instead"))
    return None


def _input_error(module, context, query, key, attention_mask, scaling, dropout, kwargs):
    """The HexiseqError this rank's attention call deserves before any communication, or None. It is not raised
    here: the call's agreement raises it on every rank (HexiSeqContext.refuse)."""
    if isinstance(attention_mask, _RefusedMask):
        return attention_mask.error
    if attention_mask is not None:
        return UnsupportedError(f"hexiseq: the attention module received an attention mask "
                                f"({type(attention_mask).__name__}{list(getattr(attention_mask, 'shape', []))}); "
                                "HexiSeq applies the causal mask by absolute position itself and supports no other "
                                "mask (pass attention_mask=None)")
    if dropout:
        return UnsupportedError(f"hexiseq: attention dropout ({dropout}) is not supported; set "
                                "config.attention_dropout = 0")
    scale = context.scale if context.scale is not None else query.shape[-1] ** -0.5  # None: the default
    if scaling is not None and not math.isclose(scaling, scale, rel_tol=1e-12):
        return UnsupportedError(f"hexiseq: {type(module).__name__} scales by {scaling}, the model's HexiSeq context "
                                f"by {scale}; every layer must use the same softmax scale")
    tokens = context.me.tokens
    if tokens == 0 and query.shape[2] == 1 and key.shape[2] == 1:
        return None  # a parked rank's empty shard, run as one placeholder token (_placeholder_in)
    if query.shape[2] != tokens or key.shape[2] != tokens:
        if key.shape[2] != query.shape[2]:
            return UnsupportedError("hexiseq: KV caches / generation are not supported (keys cover "
                                    f"{key.shape[2]} tokens, queries {query.shape[2]}); call the model with "
                                    "use_cache=False")
        got = 0 if getattr(module, _RUN, {}).get("placeholder") else query.shape[2]
        return InvalidArgumentError(
            f"hexiseq: rank {context.rank} holds {tokens} tokens under the plan but the model got {got}; "
            "feed this rank's shard: hexiseq.hf.shard_inputs(input_ids, plan, rank)")
    return None


def hexiseq_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "hexiseq" entry of transformers' AttentionInterface.

    query [batch, heads, s_r, head_dim], key/value [batch, kv_heads, s_r, head_dim] (this rank's tokens, RoPE
    applied) -> (output [batch, s_r, heads, head_dim], None).

    Every check of this rank's inputs (the mask, position_ids, the token count, what the model asks that HexiSeq
    does not execute) goes through the call's agreement: a rank that fails one makes every rank raise the same
    error, naming the rank, the field and its value."""
    context = getattr(module, _CTX, None)
    if context is None:
        raise HexiseqError(f"{type(module).__name__} runs with attn_implementation='hexiseq' but was not prepared "
                           "by hexiseq.hf.patch_model(model, plan)")
    from ..runtime.batch import BatchContext
    from ..runtime.documents import frozen
    from ..runtime.nn import hexiseq_attn_func

    documents = frozen(kwargs.get(DOCUMENTS_KWARG))
    want = getattr(module, _CHECK_POS, None)
    if isinstance(context, BatchContext):  # a model patched for batch plans attends in the active pass
        active = getattr(context, "_active", None)
        if active is None:
            raise InvalidArgumentError("a model patched with a BatchContext runs inside `with pass_:` for a pass of "
                                       "BatchContext.step(...); feed it pass_.hf_inputs(token_ids)")
        if active.context is None:  # an EmptyPass (padded_passes): its placeholder token attends to nothing
            return active.attention(*(x.transpose(1, 2) for x in (query, key, value))), None
        context = active.context
        want = torch.as_tensor(active.positions) if want is not None else None
        if documents != active.documents:
            context.refuse(InvalidArgumentError(
                f"hexiseq: the model got documents {documents} but the active pass packs {active.documents}; feed it "
                "pass_.hf_inputs(token_ids)"))
    parked = context.me.tokens == 0 and query.shape[2] == 1 and key.shape[2] == 1
    try:  # whatever a check raises, the other ranks must learn of it in the agreement, not wait for this rank
        error = _input_error(module, context, query, key, attention_mask, scaling, dropout, kwargs)
        if error is None and want is not None and not parked:
            error = _check_positions(kwargs.get("position_ids"), want, documents, context.rank)
    except Exception as e:  # noqa: BLE001
        error = e
    if error is not None:
        context.refuse(error)
    if parked:
        # a parked rank's empty shard, run as one placeholder token (_placeholder_in): attention runs its collectives
        # with no tokens, and the placeholder's output, 0, is tied to that empty output so that the backward's
        # collectives run too
        out = hexiseq_attn_func(*(x.transpose(1, 2)[:, :0] for x in (query, key, value)), context, documents,
                                **_variant(kwargs))
        return out.new_zeros(out.shape[0], 1, out.shape[2], out.shape[3]) + out.sum(), None
    q = query.transpose(1, 2)   # [batch, s_r, heads, head_dim]
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    out = hexiseq_attn_func(q, k, v, context, documents, **_variant(kwargs))
    return out, None


def _variant(kwargs):
    """The layer's window, soft-capping and sinks from what transformers passes the attention function: its
    sliding_window of W tokens (a key at most W - 1 positions back: the mask functions keep q - k < W), softcap
    (Gemma 2) and s_aux, the sink logits (gpt-oss)."""
    window = kwargs.get("sliding_window")
    return {"window": None if window is None else (int(window) - 1, 0), "softcap": kwargs.get("softcap"),
            "sinks": kwargs.get("s_aux")}


def _check_positions(pos, want, documents, rank):
    """The InvalidArgumentError position_ids deserve, or None. They must be what RoPE needs at this rank's tokens
    (their absolute positions `want`): those positions, or with packed documents the positions restarting at each
    document (plus any one offset per row, the collator's position_ids_start)."""
    if documents is not None:
        from ..runtime.ops import document_starts

        rows = documents if isinstance(documents, tuple) and all(isinstance(r, tuple) for r in documents) else \
            (documents,)
        try:
            starts = torch.stack([torch.as_tensor(document_starts(r, want.numpy())) for r in rows])
        except InvalidArgumentError:
            return None  # bad documents: the attention call refuses them on every rank alike
        want = want - starts   # [1 or batch rows, s_r]
    want = want.reshape(-1, want.shape[-1])
    if pos is None:
        got = "got none"
    elif not torch.is_tensor(pos) or pos.dim() == 0 or pos.shape[-1] != want.shape[-1]:
        got = f"got shape {list(getattr(pos, 'shape', []))}, want {want.shape[-1]} positions per row"
    elif pos.reshape(-1, pos.shape[-1]).shape[0] not in (1, want.shape[0]) and want.shape[0] != 1:
        got = f"got {pos.reshape(-1, pos.shape[-1]).shape[0]} rows, want 1 or {want.shape[0]}"
    else:
        flat = pos.reshape(-1, pos.shape[-1])
        diff = flat - want.to(pos.device)
        bad = diff != (diff[:, :1] if documents is not None else 0)
        if not bool(bad.any()):
            return None
        b, t = (int(i) for i in torch.nonzero(bad)[0])
        expect = int(want[b if want.shape[0] > 1 else 0, t]) + (int(diff[b, 0]) if documents is not None else 0)
        got = f"position_ids[{b}, {t}] is {int(flat[b if flat.shape[0] > 1 else 0, t])}, want {expect}"
    if documents is not None:
        return InvalidArgumentError(
            f"hexiseq: position_ids must be rank {rank}'s shard of the packed sequence's position ids, restarting at "
            f"each document (what DataCollatorWithFlattening gives), so that RoPE sees where each token sits in its "
            f"document ({got}; use hexiseq.hf.shard_inputs(input_ids, plan, rank, position_ids=full_position_ids))")
    return InvalidArgumentError(
        f"hexiseq: position_ids must be the absolute positions of rank {rank}'s tokens, plan.positions(rank), so "
        f"that RoPE sees where each token sits in the full sequence ({got}; use hexiseq.hf.shard_inputs(input_ids, "
        "plan, rank))")


# ------------------------------------------------------------------------------------------ patching

def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _attention_modules(model):
    """The modules that dispatch through ALL_ATTENTION_FUNCTIONS with the Llama pattern."""
    out = []
    for name, m in model.named_modules():
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            out.append((name, m))
    return out


def _own_config(model):
    """Give `model` its own copy of its config, so that what patch_model sets there (the attention implementation,
    use_cache) reaches neither the config object the caller holds nor another model built from it. transformers'
    modules keep the config they were built with (an attention module reads self.config._attn_implementation at
    every call): every module's reference to the config, or to a config nested in it (a composite model's
    text_config), is pointed at its counterpart in the copy."""
    from transformers import PretrainedConfig

    twins, todo = {}, [(model.config, copy.deepcopy(model.config))]
    while todo:
        old, new = todo.pop()
        if id(old) in twins:
            continue
        twins[id(old)] = new
        for key, value in vars(old).items():
            if isinstance(value, PretrainedConfig) and isinstance(getattr(new, key, None), PretrainedConfig):
                todo.append((value, getattr(new, key)))
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in twins:
                module.__dict__[key] = twins[id(value)]


def _placeholder_in(run, module, args, kwargs):
    """Forward pre-hook of the patched model's decoder stack (model.base_model): an empty shard (a rank the plan
    parks holds no tokens) runs as one placeholder token, since transformers' modules cannot run an empty sequence.
    Every per-token input ([batch, 0, ...]: input_ids, inputs_embeds, position_ids, attention_mask) becomes
    [batch, 1, ...] of ones: an attention mask that masks nothing, a position and a token id whatever the
    vocabulary. The placeholder's attention output is 0 (hexiseq_attention_forward) and _placeholder_out drops it."""
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds")
    run["placeholder"] = empty = torch.is_tensor(x) and x.dim() >= 2 and x.shape[1] == 0
    if not empty:
        return None

    def one(t):
        if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] == 0:
            return t.new_ones((t.shape[0], 1) + tuple(t.shape[2:]))
        return t
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _placeholder_out(run, module, args, output):
    """Forward hook of the decoder stack: after a placeholder run (_placeholder_in) the hidden states are cut back
    to the shard's 0 tokens, still tied to the graph, so that the model's outputs (logits [batch, 0, vocab]) hold
    as many tokens as the plan gives the rank and the backward runs the attention layers' collectives."""
    if not run["placeholder"]:
        return None
    run["placeholder"] = False

    def cut(t):
        return t[:, :0] if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] == 1 else t
    if isinstance(output, tuple):  # return_dict=False: the last hidden state first
        return (cut(output[0]),) + tuple(output[1:])
    for key in ("last_hidden_state", "hidden_states"):
        value = output.get(key) if hasattr(output, "get") else None
        if value is not None:
            output[key] = tuple(cut(h) for h in value) if isinstance(value, tuple) else cut(value)
    return output


def patch_model(model, plan, group=None):
    """Make `model` (a Llama-family transformers model) run its attention with HexiSeq on this rank's shard.

    Collective: every rank of `group` (default: the world; rank r = cluster device r of the plan) calls it with
    the same plan. Returns the model (patched in place). The model gets its own copy of its config, which the
    patch changes: the config object it was built from stays as it was, and models built from it later run
    unpatched.

    Call the patched model with this rank's shard and the absolute positions of its tokens::

        out = model(input_ids=plan.shard(input_ids, 1, rank),
                    position_ids=torch.as_tensor(plan.positions(rank)).unsqueeze(0))
        # or: out = model(**hexiseq.hf.shard_inputs(input_ids, plan, rank))

    and no attention mask (HexiSeq masks causally by absolute position; an all-ones padding mask is accepted,
    anything else raises). Packed documents: `shard_inputs(input_ids, plan, rank, position_ids=full_position_ids)`
    (see the module's docstring). The logits are those of the rank's tokens; `sharded_causal_lm_loss` turns them
    into the global loss. `model.config.use_cache` is set to False (no KV caches / generation while patched).

    A rank the plan parks feeds its empty shard like any other (plan.shard and shard_inputs give it 0 tokens) and
    gets logits [batch, 0, vocab]: the model runs it as one placeholder token whose attention output is 0, so that
    its attention layers take part in the collectives (transformers' modules cannot run an empty sequence).

    Memory features: where the plan chose them for this rank's device (`plan.memory_features(rank)`), each decoder
    layer's MLP is wrapped in hexiseq.nn.TiledMLP, and its checkpoint keeps its input in host memory
    (hexiseq.nn.offloaded_checkpoint; where any device offloads, every rank's model checkpoints, enabled
    non-reentrant when it was off, since the recompute repeats the attention's collectives). A tiled loss is the
    caller's: `sharded_causal_lm_loss_from_hidden` on the decoder's output. unpatch_model undoes all of it.

    Raises InvalidArgumentError when the model's num_attention_heads / num_key_value_heads differ from
    plan.model.heads / kv_heads, UnsupportedError for a model whose attention does not follow the
    AttentionInterface pattern or that uses something HexiSeq does not execute (dropout). Tested with transformers
    5.24.0: LlamaForCausalLM, MistralForCausalLM (with and without a window), Qwen2ForCausalLM, Gemma2ForCausalLM,
    Gemma3ForCausalLM, GptOssForCausalLM."""
    attn_fns, mask_fns = _transformers()
    from ..runtime.batch import BatchContext
    from ..runtime.nn import HexiSeqContext

    if getattr(model, _CTX, None) is not None:
        unpatch_model(model)
    batch_context = plan if isinstance(plan, BatchContext) else None
    if batch_context is not None:
        plan = batch_context.planner  # its model: the heads every pass's plan has
    elif hasattr(plan, "one_layout"):  # a hexiseq.Plan: of one layout, or of one group making one pass
        plan = plan.one_layout("patch_model")
    cfg = _text_config(model)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is None:
        raise UnsupportedError(f"{type(model).__name__}: the config has no num_attention_heads")
    if (heads, kv_heads) != (plan.model.heads, plan.model.kv_heads):
        raise InvalidArgumentError(
            f"the model has num_attention_heads={heads}, num_key_value_heads={kv_heads} but the plan was made for "
            f"heads={plan.model.heads}, kv_heads={plan.model.kv_heads}; plan with "
            "hexiseq.Model.from_hf_config(model.config)")
    if hasattr(type(model), "_can_set_attn_implementation") and not type(model)._can_set_attn_implementation():
        raise UnsupportedError(f"{type(model).__name__} does not dispatch attention through transformers' "
                               "AttentionInterface; hexiseq.hf cannot patch it")
    modules = _attention_modules(model)
    if not modules:
        raise UnsupportedError(f"{type(model).__name__}: no Llama-style attention modules (q_proj, k_proj, v_proj, "
                               "o_proj, scaling) found")
    if getattr(cfg, "attention_dropout", 0.0):
        raise UnsupportedError(f"attention dropout ({cfg.attention_dropout}) is not supported; set "
                               "config.attention_dropout = 0")
    for name, m in modules:
        if getattr(m, "is_causal", True) is False:
            raise UnsupportedError(f"{name} is not causal; hexiseq.hf supports causal self-attention only")
    scales = {float(m.scaling) for _, m in modules}
    if len(scales) != 1:
        raise UnsupportedError(f"the attention layers use different softmax scales {sorted(scales)}")

    if batch_context is not None:
        scale = min(scales)
        expected = batch_context.scale if batch_context.scale is not None else float(modules[0][1].head_dim) ** -0.5
        if not batch_context.causal or abs(expected - scale) > 1e-12 * scale:
            raise InvalidArgumentError(f"the BatchContext attends with causal={batch_context.causal}, softmax_scale="
                                       f"{expected} but the model's attention is causal with scale {scale}: make it "
                                       f"hexiseq.nn.BatchContext(planner, softmax_scale={scale})")
        context, positions = batch_context, torch.zeros(0, dtype=torch.long)  # positions: the active pass's
    else:
        context = HexiSeqContext(plan, group=group, causal=True, softmax_scale=scales.pop())
        positions = torch.as_tensor(plan.positions(context.rank), dtype=torch.long)
    attn_fns.register(ATTN_IMPLEMENTATION, hexiseq_attention_forward)
    mask_fns.register(ATTN_IMPLEMENTATION, _hexiseq_mask)

    state = {"attn_implementation": model.config._attn_implementation,
             "use_cache": getattr(model.config, "use_cache", None)}
    _own_config(model)
    run = {"placeholder": False}
    stack = getattr(model, "base_model", model)
    state["hooks"] = [stack.register_forward_pre_hook(functools.partial(_placeholder_in, run), with_kwargs=True),
                      stack.register_forward_hook(functools.partial(_placeholder_out, run))]
    for i, (_, m) in enumerate(modules):
        setattr(m, _CTX, context)
        setattr(m, _CHECK_POS, positions if i == 0 else None)   # check position_ids once per forward, in layer 0
        setattr(m, _RUN, run)
    _set_attn_implementation(model, ATTN_IMPLEMENTATION)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    model._hexiseq_context = context
    model._hexiseq_saved = state
    if batch_context is None:
        state["memory"] = _apply_memory_features(model, plan, context.rank)
    return model


def _apply_memory_features(model, plan, rank):
    """What the plan chose for this rank's device to fit its memory (plan.memory_features): each decoder layer's
    MLP wrapped in hexiseq.nn.TiledMLP, and its checkpoint made an offloaded one (hexiseq.nn.offloaded_checkpoint).
    Where any device offloads, every rank checkpoints (enabled, non-reentrant, where it was not): a checkpoint's
    recompute calls the attention layer's collectives again, so the ranks must recompute alike. Returns what to
    undo."""
    from ..runtime.offload import OffloadCheckpoints, offloaded_checkpoint
    from ..runtime.tiled import TiledMLP

    chosen = plan.memory_features(rank)
    layers = [m for _, m in _decoder_layers(model)]
    undo = {"mlp": [], "checkpoint": [], "enabled": False}
    if chosen["mlp_tiles"] > 1:
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, torch.nn.Module) and not isinstance(mlp, TiledMLP):
                layer.mlp = TiledMLP(mlp, chosen["mlp_tiles"])
                undo["mlp"].append((layer, mlp))
    if any(plan.memory_features(d)["offload"] for d in range(plan.cluster.num_devices)):
        if not any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:  # pragma: no cover (transformers before activation_checkpointing_enable)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            undo["enabled"] = True
    if chosen["offload"]:
        offloader = OffloadCheckpoints()
        model._hexiseq_offloader = offloader
        for layer in layers:
            undo["checkpoint"].append((layer, layer.__dict__.get("_gradient_checkpointing_func")))
            layer._gradient_checkpointing_func = functools.partial(offloaded_checkpoint, offloader=offloader)
    return undo


def keep_offloading(model):
    """Put the offloading checkpoint back on every decoder layer of a model patch_model made offload, if something
    set the layers' checkpoint function again since (transformers' Trainer enables checkpointing itself when
    TrainingArguments(gradient_checkpointing=True), at the start of train()). Cheap; hexiseq.trainer calls it every
    step. A no-op for a model that does not offload."""
    from ..runtime.offload import offloaded_checkpoint

    offloader = getattr(model, "_hexiseq_offloader", None)
    if offloader is None:
        return
    for _, layer in _decoder_layers(model):
        fn = layer.__dict__.get("_gradient_checkpointing_func")
        if not (isinstance(fn, functools.partial) and fn.func is offloaded_checkpoint):
            layer._gradient_checkpointing_func = functools.partial(offloaded_checkpoint, offloader=offloader)


def _restore_memory_features(model, undo):
    for layer, mlp in undo["mlp"]:
        layer.mlp = mlp
    for layer, fn in undo["checkpoint"]:
        if fn is None:
            layer.__dict__.pop("_gradient_checkpointing_func", None)
        else:
            layer._gradient_checkpointing_func = fn
    if undo["enabled"]:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
    model.__dict__.pop("_hexiseq_offloader", None)


def _decoder_layers(model):
    """The model's checkpointable decoder layers (transformers' GradientCheckpointingLayer), by name."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover (older transformers)
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]


def _set_attn_implementation(model, impl):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # pragma: no cover (older transformers)
        model.config._attn_implementation = impl
    if model.config._attn_implementation != impl:
        raise UnsupportedError(f"{type(model).__name__} did not accept attn_implementation={impl!r}")


def unpatch_model(model):
    """Undo `patch_model`: the previous attention implementation and use_cache come back (in the model's own copy
    of the config, which it keeps). The HexiSeq context's process groups are left alone. Returns the model."""
    state = getattr(model, "_hexiseq_saved", None)
    if state is None:
        return model
    if "memory" in state:
        _restore_memory_features(model, state["memory"])
    for handle in state.get("hooks", ()):
        handle.remove()
    for _, m in _attention_modules(model):
        for attr in (_CTX, _CHECK_POS, _RUN):
            if hasattr(m, attr):
                delattr(m, attr)
    _set_attn_implementation(model, state["attn_implementation"] or "eager")
    if state["use_cache"] is not None:
        model.config.use_cache = state["use_cache"]
    del model._hexiseq_context
    del model._hexiseq_saved
    return model


# ------------------------------------------------------------------------------------------ inputs and loss

def _rank(plan, rank, group):
    if rank is None:
        rank = dist.get_rank(resolve_group(group))
    return rank


def _agreed(group, fields, values, check):
    """Run `check()` (this rank's input checks, returning what the caller needs) and agree with every rank of
    `group` on `values` (ints, one per field) and on whether each rank's checks passed, so that a rank that fails one
    makes every rank raise the same error at once instead of leaving the others waiting in the next collective.
    Without an initialised torch.distributed (every rank's inputs prepared in one process) the check alone runs."""
    from ..runtime.comm import agree, collective_device

    if not dist.is_available() or not dist.is_initialized():
        return check()
    group = resolve_group(group)
    result, error = None, None
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - whatever a check raises, the other ranks must learn of it
        error = e
    agree(group, values, fields, error, device=collective_device(group))
    return result


def shard_inputs(input_ids, plan, rank=None, group=None, position_ids=None):
    """{"input_ids": this rank's shard of `input_ids` [batch, seq_len], "position_ids": [1, s_r] absolute positions,
    "attention_mask": [batch, s_r] all ones} to call a patched model with: `model(**shard_inputs(input_ids, plan,
    rank))`.

    Packed documents (several documents in one sequence, as transformers' DataCollatorWithFlattening makes them):
    pass the FULL sequence's `position_ids` ([1 or batch, seq_len], restarting at each document). The documents are
    read from them (a document starts wherever a position id is not its predecessor's plus one) and the result
    also holds "hexiseq_documents" (their lengths, which the patched attention reads: every query then sees only
    its own document) and "position_ids" becomes this rank's shard of the given ones (RoPE rotates each token by
    its place in its document).

    A rank the plan parks (no tokens) gets its empty shard, as from plan.shard (s_r = 0): it must still run the
    model, so that its attention layers take part in the collectives, and the patched model takes the empty shard
    (see patch_model) and returns logits [batch, 0, vocab], which sharded_causal_lm_loss takes.
    The all-ones mask masks nothing (HexiSeq masks causally by absolute position); without a mask transformers
    inspects position_ids for packed sequences, which only finds the shard's chunk boundary (HexiSeq ignores it).

    Collective when torch.distributed is initialised (one all_gather of a few ints over `group`): the ranks agree
    on the plan, the batch size and the documents, and a rank whose inputs are refused makes every rank raise the
    same error, naming it, instead of leaving the others waiting in the model's first collective."""
    from ..runtime.comm import documents_code, plan_code

    rank = _rank(plan, rank, group)

    def check():
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] != plan.seq_len:
            raise InvalidArgumentError(f"input_ids must be a [batch, {plan.seq_len}] tensor (the full sequence), got "
                                       f"{_shape_words(input_ids)}")
        documents = None
        if position_ids is None:
            pos = torch.as_tensor(plan.positions(rank), dtype=torch.long, device=input_ids.device).unsqueeze(0)
        else:
            documents = documents_from_position_ids(position_ids, plan.seq_len)
            pos = plan.shard(torch.as_tensor(position_ids).reshape(-1, plan.seq_len), 1, rank)
        ids = plan.shard(input_ids, 1, rank)
        out = {"input_ids": ids, "position_ids": pos, "attention_mask": torch.ones_like(ids, dtype=torch.long)}
        if documents is not None:
            out[DOCUMENTS_KWARG] = documents
        return out

    batch = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else -1
    try:
        rows = documents_from_position_ids(position_ids, plan.seq_len) if position_ids is not None else None
        docs = documents_code(rows if rows is None or isinstance(rows[0], tuple) else (rows,))
    except Exception:  # noqa: BLE001 - refused in check(), through the agreement
        docs = -1
    return _agreed(group, ("plan", "batch", "documents"), (plan_code(plan), batch, docs), check)


def _shape_words(x):
    return f"{type(x).__name__} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def documents_from_position_ids(position_ids, seq_len=None):
    """The lengths of the documents packed in a sequence, from its position ids ([seq_len] or [rows, seq_len], a
    tensor or a list), which restart at each document: a document starts at position 0 and wherever a position
    id is not its predecessor's plus one (transformers' own rule for packed sequences). Returns a tuple of
    lengths, or a tuple of such tuples, one per row, when the rows differ."""
    pos = torch.as_tensor(position_ids)
    pos = pos.reshape(1, -1) if pos.dim() == 1 else pos
    if pos.dim() != 2 or pos.shape[1] == 0 or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise InvalidArgumentError(f"position_ids must be integer [rows, seq_len], got {pos.dtype} "
                                   f"{list(pos.shape)}")
    if seq_len is not None and pos.shape[1] != seq_len:
        raise InvalidArgumentError(f"position_ids must cover the full sequence of the plan, {seq_len} tokens (before "
                                   f"sharding), got {pos.shape[1]}")
    pos = pos.detach().cpu()
    starts = torch.ones(pos.shape, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    rows = []
    for row in starts:
        at = torch.nonzero(row).flatten().tolist() + [pos.shape[1]]
        rows.append(tuple(b - a for a, b in zip(at, at[1:])))
    return rows[0] if all(r == rows[0] for r in rows) else tuple(rows)


def sharded_causal_lm_loss(logits, labels_full, plan, rank=None, group=None, ignore_index: int = -100):
    """The global next-token loss from this rank's logits, equal to the unpatched model's
    `model(input_ids, labels=labels_full).loss`: the mean, over every position p of the full sequence whose next
    label labels_full[:, p + 1] is not ignore_index, of cross_entropy(logits[p], labels_full[:, p + 1]).

    logits: [batch, s_r, vocab], this rank's tokens in shard order (a patched model's output; s_r = 0 on a rank
    the plan parks, whose loss term is then 0, tied to the logits so that the backward runs its model).
    labels_full: [batch, seq_len] the labels of the FULL sequence (every rank needs them: the label of a rank's
    last token of a chunk is the first token of another rank's chunk); usually the input ids.
    Collective (an agreement on the plan, the batch, ignore_index and every rank's input checks, then one
    all_reduce of a scalar over `group`): a rank whose inputs are refused makes every rank raise the same error. The
    value is the global loss on every rank; its gradient
    is that of this rank's share only (sum over its tokens / global count), so after `loss.backward()` on every
    rank, summing the parameter gradients over the ranks gives the gradient of the global loss.

    Precision: computed in float32 for half-precision logits and in float64 for float64 logits (transformers'
    own loss casts to float32 even for float64 models)."""
    return _sharded_loss(logits, None, labels_full, plan, rank, group, ignore_index, None)


def sharded_causal_lm_loss_from_hidden(hidden, head_weight, labels_full, plan, rank=None, group=None,
                                       ignore_index: int = -100, tiles=None):
    """sharded_causal_lm_loss from this rank's last hidden states and the LM head's weight, the logits computed a
    tile of tokens at a time and recomputed in the backward (hexiseq.nn.tiled_cross_entropy): one tile's logits in
    memory instead of [s_r, vocab]. hidden: [1, s_r, hidden_size] (the decoder's output, e.g.
    `model.model(**inputs).last_hidden_state`); head_weight: [vocab, hidden_size] (`model.lm_head.weight`; a model
    that soft-caps its logits needs the logits and sharded_causal_lm_loss). tiles: None for what the plan chose for
    this rank's device (`plan.memory_features(rank)["loss_tiles"]`, 1 where it chose no tiling), else a count.
    Collective and exact as sharded_causal_lm_loss (up to the order of the sums over tiles)."""
    return _sharded_loss(hidden, head_weight, labels_full, plan, rank, group, ignore_index, tiles)


def _sharded_loss(x, head_weight, labels_full, plan, rank, group, ignore_index, tiles):
    """The two losses above: x is the logits (head_weight None) or the hidden states."""
    import torch.nn.functional as F

    from ..runtime.comm import plan_code
    from ..runtime.tiled import tiled_cross_entropy

    rank = _rank(plan, rank, group)
    group = resolve_group(group)
    what = "logits" if head_weight is None else "hidden"
    width = "vocab" if head_weight is None else "hidden_size"

    def check():
        if not isinstance(labels_full, torch.Tensor) or labels_full.dim() != 2 or labels_full.shape[1] != plan.seq_len:
            raise InvalidArgumentError(f"labels_full must be [batch, {plan.seq_len}] (the full sequence), "
                                       f"got {_shape_words(labels_full)}")
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{what} must be a [batch, tokens, {width}] tensor, got {type(x).__name__}")
        if head_weight is not None and (not isinstance(head_weight, torch.Tensor) or head_weight.dim() != 2
                                        or x.dim() != 3 or head_weight.shape[1] != x.shape[-1]):
            raise InvalidArgumentError(f"head_weight must be a [vocab, {x.shape[-1] if x.dim() else '?'}] tensor "
                                       f"(the LM head's weight), got {_shape_words(head_weight)}")
        if head_weight is not None and x.dim() == 3 and x.shape[0] != 1:
            raise InvalidArgumentError(f"hidden must be [1, tokens, hidden_size] (one sequence), got {list(x.shape)}")
        if tiles is not None and (isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1):
            raise InvalidArgumentError(f"tiles must be a positive integer or None, got {tiles!r}")
        shifted = F.pad(labels_full.to(x.device), (0, 1), value=ignore_index)[:, 1:]
        mine = plan.shard(shifted, 1, rank)
        if x.dim() != 3 or x.shape[:2] != mine.shape:
            raise InvalidArgumentError(f"{what} must be [batch, tokens, {width}] = [{mine.shape[0]}, {mine.shape[1]}, "
                                       f"{width}] on rank {rank} (its tokens under the plan, as plan.shard and "
                                       f"shard_inputs give them), got {list(x.shape)}")
        return x, shifted, mine

    # the ranks agree on the plan, the batch and ignore_index, and learn of any rank's refusal, before the
    # all_reduce below (a rank that raised alone would leave the others waiting in it)
    batch = labels_full.shape[0] if isinstance(labels_full, torch.Tensor) and labels_full.dim() == 2 else -1
    x, shifted, mine = _agreed(group, ("plan", "batch", "ignore_index"),
                               (plan_code(plan), batch, int(ignore_index)), check)
    acc = torch.promote_types(x.dtype, torch.float32)
    if head_weight is None:
        local = F.cross_entropy(x.reshape(-1, x.shape[-1]).to(acc), mine.reshape(-1), ignore_index=ignore_index,
                                reduction="sum")
    else:
        n = tiles if tiles is not None else plan.memory_features(rank)["loss_tiles"]
        local = tiled_cross_entropy(x[0], head_weight, mine[0], max(1, min(n, x.shape[1])),
                                    ignore_index=ignore_index).to(acc)
    count = (shifted != ignore_index).sum().to(acc)   # same on every rank: no communication
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return (local + (total - local.detach())) / count
