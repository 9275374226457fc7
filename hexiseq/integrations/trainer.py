"""The Hugging Face `Trainer` with HexiSeq attention: one class in place of `transformers.Trainer`.

    from hexiseq.trainer import HexiSeqTrainer

    plan = hexiseq.plan(cluster, model=hexiseq.Model.from_hf_config(model.config), seq_len=4096)
    trainer = HexiSeqTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, plan=plan)
    trainer.train()                                     # under torchrun, one process per device of the plan

What it changes, and why each is needed for context parallelism:

- **The same batches on every rank.** A plain Trainer shards each batch across processes (data parallelism);
  here the ranks hold the token shards of the same sequences, so every rank reads the same batches: a sampler
  seeded with `args.data_seed` (else `args.seed`), the same on every rank, and a DataLoader that accelerate does
  not split (evaluation reads the dataset in order).
- **The model patched** (`hexiseq.hf.patch_model`, collective) when the trainer is made: its attention runs over
  the plan's ranks.
- **Each batch sharded and the loss made global.** `compute_loss` feeds each rank its tokens
  (`hexiseq.hf.shard_inputs`, with the batch's `position_ids` when it has them: packed documents from
  `DataCollatorWithFlattening` then run with a document mask) and returns `hexiseq.hf.sharded_causal_lm_loss` over
  the batch's `labels` (else its input ids): the loss of the whole sequences, equal on every rank, so the Trainer
  logs what one process would.
- **The gradients summed, not averaged.** Each rank's loss carries the gradient of its own tokens, which must be
  summed over the ranks; the DDP wrapper the Trainer puts around the model under torchrun would average them, so
  it gets a communication hook that sums (`_sum_gradients`). A run whose gradients nothing reduces (more than one
  rank and no DDP wrapper) is refused rather than trained wrongly.

Every batch must hold sequences of the plan's `seq_len` tokens (pad or pack to it; an attention mask that is not all
ones is refused by the patched attention). Evaluation gives the loss only (`prediction_loss_only`): the logits are
sharded over the ranks. Checked against a plain Trainer in one process by `examples/train_hf_trainer.py` (and
`tests/test_trainer.py`): every step's loss and the trained weights agree to float32 rounding.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from ..errors import InvalidArgumentError, UnsupportedError
from .hf import keep_offloading, patch_model, shard_inputs, sharded_causal_lm_loss

try:
    import transformers
except ImportError:  # pragma: no cover - the test environment has transformers
    raise ImportError("hexiseq.trainer needs transformers (pip install 'hexiseq[hf]')") from None

__all__ = ["HexiSeqTrainer"]


class HexiSeqTrainer(transformers.Trainer):
    """`transformers.Trainer` over a HexiSeq plan (see hexiseq.integrations.trainer). Arguments as Trainer's, plus
    `plan` (a hexiseq Plan whose devices are the ranks of `group`) and `group` (default: the world)."""

    def __init__(self, *args, plan=None, group=None, **kwargs):
        from ..planner.plan import Plan

        if not isinstance(plan, Plan):
            raise InvalidArgumentError(f"plan must be a hexiseq Plan (hexiseq.plan(...)), got {type(plan).__name__}")
        plan = plan.one_layout("HexiSeqTrainer")
        super().__init__(*args, **kwargs)  # under torchrun this initialises torch.distributed (accelerate)
        if not dist.is_available() or not dist.is_initialized():
            if plan.cluster.num_devices != 1:
                raise InvalidArgumentError(f"the plan places {plan.cluster.num_devices} devices but torch.distributed "
                                           "is not initialised: start one process per device with torchrun")
        else:
            world = dist.get_world_size(group)
            if world != plan.cluster.num_devices:
                raise InvalidArgumentError(f"the plan places {plan.cluster.num_devices} devices but the process group "
                                           f"has {world} ranks")
        self.hexiseq_plan, self.hexiseq_group = plan, group
        if dist.is_available() and dist.is_initialized():
            patch_model(self.model, plan, group)
        self.loss_is_scaled_for_ga = False  # a mean over each batch: the Trainer divides by the accumulation steps

    # ------------------------------------------------------------------------------------------ data

    def _same_batches(self, dataset, description, batch_size, shuffle):
        """A DataLoader giving every rank the same batches (not split across processes by accelerate)."""
        collator = self.data_collator
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise UnsupportedError("HexiSeqTrainer needs a dataset with a length (an IterableDataset would be read "
                                   "differently by each rank's workers)")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if shuffle \
            else SequentialSampler(dataset)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collator,
                          drop_last=self.args.dataloader_drop_last, num_workers=self.args.dataloader_num_workers,
                          pin_memory=self.args.dataloader_pin_memory)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise InvalidArgumentError("HexiSeqTrainer: training needs a train_dataset")
        return self._same_batches(self.train_dataset, "training", self._train_batch_size, shuffle=True)

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            raise UnsupportedError("HexiSeqTrainer evaluates one dataset at a time, not a dict of them")
        if dataset is None:
            raise InvalidArgumentError("HexiSeqTrainer: evaluation needs an eval_dataset")
        return self._same_batches(dataset, "evaluation", self.args.eval_batch_size, shuffle=False)

    # ------------------------------------------------------------------------------------------ the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        plan, group = self.hexiseq_plan, self.hexiseq_group
        if "input_ids" not in inputs:
            raise InvalidArgumentError(f"HexiSeqTrainer: a batch must hold input_ids, got {sorted(inputs)}")
        input_ids = inputs["input_ids"]
        labels = inputs.get("labels", input_ids)
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(torch.all(mask != 0)):
            # refused on every rank alike: every rank reads the same batch
            raise UnsupportedError("HexiSeqTrainer: an attention_mask with zeros (padding) is not supported; pad "
                                   "with tokens the labels ignore (-100) or pack the sequences instead")
        keep_offloading(self.model)  # train() may have set the layers' checkpoint function again
        sharded = shard_inputs(input_ids, plan, group=group, position_ids=inputs.get("position_ids"))
        outputs = model(**sharded)
        loss = sharded_causal_lm_loss(outputs.logits, labels, plan, group=group)
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if world > 1 and model.training:
            _sum_gradients(model)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


def _sum_hook(process_group, bucket):
    """DDP communication hook: the bucket's gradients summed over the ranks (DDP's own averages them)."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _sum_gradients(model):
    """Make the DDP wrapper the Trainer put around the model sum the ranks' gradients instead of averaging them:
    each rank's loss carries the gradient of its own tokens, and the whole sequences' gradient is their sum. A
    communication hook rather than the loss scaled by the world size: the scaled loss gives the same gradient in
    exact arithmetic, but models that run parts in float32 (transformers' RMSNorm does, even in a float64 model)
    round the larger upstream gradient differently (1e-7 relative, measured), where the hook's sum matches a
    manual all-reduce to the last bits."""
    if getattr(model, "_hexiseq_sums", False):
        return
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise UnsupportedError(f"HexiSeqTrainer: the model is not wrapped by DistributedDataParallel (got "
                               f"{type(model).__name__}): nothing would sum the ranks' gradients")
    try:
        model.register_comm_hook(model.process_group, _sum_hook)
    except RuntimeError as e:  # a hook of the user's is already there
        raise UnsupportedError(f"HexiSeqTrainer needs the DDP wrapper's communication hook to sum gradients, and "
                               f"could not register it: {e}") from None
    model._hexiseq_sums = True
