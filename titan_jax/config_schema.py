"""The run configuration's schema: TorchTitan's TOML sections and keys as typed dataclasses,
each field with its default and a comment. Loading, overrides and validation: `config.py`."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from titan_jax.errors import TitanJaxError
from titan_jax.yarn import YarnScaling


class ConfigError(TitanJaxError, ValueError):
    """A bad configuration: the message names the field, the value, and what is valid."""


# The one spelling of "auto" (or "all", "newest") in integer keys.
AUTO = -1


@dataclasses.dataclass
class Job:
    dump_folder: str = "./outputs"  # metrics.jsonl, loss.png, tb/ and checkpoint/ go here
    description: str = ""  # free text, recorded in metrics_header.json
    # Simulated CPU devices (XLA host platform); 0 leaves JAX's default. Set before JAX starts.
    cpu_devices: int = 0


@dataclasses.dataclass
class Model:
    name: str = "qwen3"  # the model family (the registry in titan_jax/models)
    # A flavour of the family: debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B; MoE: debugmodel_moe,
    # 30B-A3B, 235B-A22B.
    flavor: str = "debugmodel"
    # tokenizer.json (or a directory holding one); "" = the tokenizer shipped with titan-jax.
    tokenizer_path: str = ""
    # Attention kernel: "xla" (einsum + softmax, scores materialised: memory ~ seq_len^2),
    # "splash" (Pallas TPU flash kernel; seq_len a multiple of 128; interpreted, slowly, on
    # CPU), "cudnn" (cuDNN fused attention, GPU, bf16). "auto": splash on TPU, cudnn on GPU with
    # bf16 compute, xla otherwise (by the devices trained on, also when compiling ahead of time).
    attention: Literal["auto", "xla", "splash", "cudnn"] = "auto"
    # RoPE: "default" (the flavour's: plain) or "yarn" (YaRN as HF computes it, from the yarn_*
    # keys; HF's rope_parameters). Qwen3 reaches 128K from its native 32K: factor 4, 32768.
    # Each `yarn_<field>` is titan_jax/yarn.py's YarnScaling.<field> (its default and range).
    rope_type: Literal["default", "yarn"] = "default"
    yarn_factor: float = YarnScaling.factor  # >= 1: how much longer than the original window
    yarn_original_max_position_embeddings: int = (  # the window pre-training used
        YarnScaling.original_max_position_embeddings
    )
    yarn_beta_fast: float = YarnScaling.beta_fast  # dims turning more often than this are kept
    yarn_beta_slow: float = YarnScaling.beta_slow  # dims turning less often are interpolated
    yarn_attention_factor: float = YarnScaling.attention_factor  # 0 = 0.1 * ln(factor) + 1
    yarn_truncate: bool = YarnScaling.truncate  # round the ramp's ends to whole dims (HF)


@dataclasses.dataclass
class MixtureSource:
    """One `[[training.mixture]]` table: token stores and their share of the samples."""

    path: str = ""  # token store folder(s): comma-separated, globs allowed, local or URL
    weight: float = 1.0  # relative: the shares are weight / sum of weights


@dataclasses.dataclass
class Training:
    # Data: "tokens" (token stores written by `titan-jax prepare-data`, at dataset_path: one
    # folder, several comma-separated, or a glob; local or gs://... URLs) | "pydoc" (embedded
    # corpus) | "text" | "jsonl" | "parquet" | "hf_disk" (prepared into a store under
    # {dump_folder}/data on first use).
    dataset: Literal["tokens", "pydoc", "text", "jsonl", "parquet", "hf_disk"] = "pydoc"
    dataset_path: str = ""  # store folder(s) for "tokens"; file, directory or glob for files
    text_field: str = "text"  # field/column holding the text (jsonl, parquet, hf_disk)
    # What jsonl/parquet records hold: "text" (a document in text_field) | "messages" (a
    # conversation: `messages`, a list of {role, content}, and optional `tools`) |
    # "prompt_completion" (`prompt` and `completion`: strings or lists of messages) |
    # "preference" (`prompt`, `chosen`, `rejected`: TRL's preference pairs, trained by DPO,
    # [dpo]). Conversations are rendered with the chat template and only the assistant's
    # tokens are trained on (SFT, docs/POSTTRAINING.md); validation reads its files the same way.
    data_format: Literal["text", "messages", "prompt_completion", "preference"] = "text"
    # How "messages" / "prompt_completion" rows are cut: "whole" (each row holds whole
    # conversations, best-fit packed, then padding; one longer than seq_len keeps its start;
    # needs document_mask and document_positions) | "window" (fixed windows of the packed
    # stream: no padding, but a conversation may straddle two rows).
    sft_packing: Literal["whole", "window"] = "whole"
    # The chat template: a .jinja file, a tokenizer_config.json or a folder holding either;
    # "" = the tokenizer's own (beside model.tokenizer_path; the shipped tokenizer has one).
    chat_template: str = ""
    # Several token stores with weights (`[[training.mixture]]` tables of path and weight),
    # interleaved deterministically; replaces dataset/dataset_path when given.
    mixture: list[MixtureSource] = dataclasses.field(default_factory=list)
    # Attention stays inside each document of a packed window, and the label that would predict
    # the next document's first token is not trained on.
    document_mask: bool = False
    # With document_mask: RoPE positions restart at 0 with each document.
    document_positions: bool = False
    local_batch_size: int = 8  # sequences per data-parallel rank per microbatch
    # Sequences per optimizer step over all ranks; -1 = local x data-parallel degree. A larger
    # multiple of that means gradient accumulation over microbatches.
    global_batch_size: int = -1
    seq_len: int = 2048  # tokens per sequence
    steps: int = 10000  # optimizer steps
    max_norm: float = 1.0  # global-norm gradient clipping; 0 disables
    # Dtype weights are cast to at use (SimpleFSDP param_dtype). "auto": float32 on CPU (bf16
    # matmuls are slower there), bfloat16 on accelerators.
    mixed_precision_param: Literal["auto", "float32", "bfloat16"] = "auto"
    # Dtype of gradient reductions across data-parallel ranks (SimpleFSDP reduce_dtype).
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    seed: int = 42  # init and data order
    max_consecutive_bad_steps: int = 3  # non-finite steps in a row before the run stops


@dataclasses.dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1  # replicas (DDP, or HSDP's outer axis)
    data_parallel_shard_degree: int = -1  # -1: all devices left after the other degrees
    # Megatron tensor parallelism over a `tp` axis: attention heads, MLP hidden and vocab
    # split; must divide n_heads and n_kv_heads.
    tensor_parallel_degree: int = 1
    # Experts split over this many of the data-parallel shard ranks (MoE flavours only); the
    # token dispatch and combine are all-to-alls over it.
    expert_parallel_degree: int = 1
    # Under expert parallelism each layer's picks travel in this many exchanges, pipelined so
    # that one chunk's dispatch and another's combine run under a third's experts (docs/MOE.md);
    # must divide each device's picks (tokens x top_k a microbatch).
    expert_parallel_chunks: int = 1
    # Context parallelism: each sequence split over this many devices (a `cp` mesh axis), in
    # 2 x cp chunks, rank i holding chunks i and 2cp-1-i so causal work is equal; attention
    # all-gathers K/V over cp. Weights are also sharded over cp (one more FSDP axis).
    # training.seq_len (and validation.seq_len) must divide by 2 x cp.
    context_parallel_degree: int = 1
    # How attention sees the other cp ranks' K/V: "allgather" (one all-gather per layer, then
    # splash or xla on the whole sequence's keys; measured the lighter and faster at 32K, see
    # docs/PARALLELISM.md) or "ring" (K/V blocks passed rank to rank with ppermute, folded
    # into an online softmax; XLA blocks, so model.attention must be auto or xla).
    context_parallel_method: Literal["allgather", "ring"] = "allgather"
    # "default" = "always": free the gathered weight after forward, re-gather in backward.
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    # Gather each layer's weights one layer ahead inside the layer scan (MaxText's look-ahead
    # weight prefetch): the scan carries the next layer's gathered bf16 weights (a MoE
    # router's in fp32), so the gathers overlap a whole layer's forward (docs/TPU.md, "FSDP
    # gathers overlapped?"); costs one layer of gathered weights. activation_checkpoint.mode=
    # full and re-sharding after forward only, and with splash attention the shard_map
    # implementation; the numbers are the same as without.
    fsdp_lookahead_gather: bool = False
    # MoE: each layer's experts' w1 and w3 gathered before its router runs, under the
    # attention's compute, rather than at their use after the token dispatch (XLA:TPU queues
    # the dispatch's row permutations and the FSDP gathers on the same SparseCores; docs/MOE.md).
    # On by default: it shortens 235B-A22B's v5p-256 step at ep8. Turn it off for Ironwood's
    # fsdp512 layout, whose gradient reduce-scatters then wait (measured in
    # docs/notes/2026-12-05-qwen3-235b-step-time.md). The numbers are the same either way.
    fsdp_expert_gather_before_router: bool = True
    # "jit": gathers/reductions placed by the compiler (GSPMD); "shard_map": the explicit
    # all_gather/psum_scatter twin (same rules, same losses), which also hosts expert
    # parallelism's all-to-alls and context parallelism's K/V gathers. "auto": shard_map with
    # expert or context parallelism, or MoE on TPU/GPU (ragged_dot does not compile under the
    # jit path's vmap), else jit.
    fsdp_implementation: Literal["auto", "jit", "shard_map"] = "auto"
    # Slices joined over the data-centre network (DCN); -1: from the devices (TPU multislice
    # devices know their slice; others make one slice). The DCN axis carries HSDP's replicate
    # degree when it divides it, else the FSDP degree; every other axis stays inside a slice.
    num_slices: int = -1
    # Pipeline parallelism: the stacked layers split into this many stages over a `pp` mesh axis
    # (the rules table's `layers` rule), each stage's activations sent to the next by a
    # collective-permute; with several slices pp spans them when the slice count divides it.
    # Must divide n_layers (x the virtual stages); docs/PARALLELISM.md, "Pipeline parallelism".
    pipeline_parallel_degree: int = 1
    # "gpipe": each stage holds one chunk of consecutive layers; "interleaved": each holds
    # `pipeline_parallel_virtual_stages` chunks placed round-robin (chunk c on stage c mod pp,
    # MaxText's circular pipeline), a smaller bubble for more sends; in both backward runs
    # after the whole forward. "1f1b": gpipe's placement and bubble, forward and backward
    # alternating, so a stage keeps 2 (pp - 1) microbatches' inputs, not all of them.
    pipeline_parallel_schedule: Literal["gpipe", "interleaved", "1f1b"] = "gpipe"
    # Chunks per stage under "interleaved" (>= 2); 1 under "gpipe" and "1f1b".
    pipeline_parallel_virtual_stages: int = 1
    # Slices of each (gradient-accumulation) microbatch's rows that flow through the stages;
    # -1: pipeline_parallel_degree. At least the degree; must divide the local batch size.
    pipeline_parallel_microbatches: int = -1
    # Rules of the sharding table (titan_jax/parallel/rules.py) replaced for this recipe:
    # logical axis -> the mesh axes that split it ([] = none), e.g. a TOML table
    # `[parallelism.sharding_rules]` with `kv_heads = []` (K/V heads replicated over tp, for a
    # tensor-parallel degree that does not divide them), or `--parallelism.sharding_rules
    # kv_heads=,mlp=tp` (mesh axes joined by +). Checked like the table itself.
    sharding_rules: dict[str, list[str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"  # optax AdamW, decoupled weight decay on every parameter
    lr: float = 8e-4  # peak learning rate
    beta1: float = 0.9  # first-moment decay
    beta2: float = 0.95  # second-moment decay
    eps: float = 1e-8  # added to the second moment's square root
    weight_decay: float = 0.1  # decoupled (AdamW), applied to every parameter


@dataclasses.dataclass
class LRScheduler:
    warmup_steps: int = 200  # linear warmup, (step+1)/warmup_steps
    # Fraction of steps spent decaying; None = decay over everything after warmup.
    decay_ratio: float | None = None
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"  # shape of the decay
    min_lr_factor: float = 0.0  # decay floor as a fraction of optimizer.lr


@dataclasses.dataclass
class ActivationCheckpoint:
    # none: keep all activations; full: recompute each block in backward; selective: save the
    # matmul outputs and attention's, recompute the cheap elementwise ops; offload: selective
    # with the saved activations in host memory (TPU/GPU; runs as selective on CPU devices).
    mode: Literal["none", "full", "selective", "offload"] = "selective"
    # Keep each layer's input (what full remat saves of a layer) in host memory between forward
    # and backward, as MaxText's decoder_layer_input=offload: the device then holds none of the
    # layers x batch x seq x dim inputs. TPU/GPU (off on CPU devices, with a warning).
    offload_layer_input: bool = False


@dataclasses.dataclass
class Checkpoint:
    enable: bool = False  # save checkpoints and resume from them
    # Under job.dump_folder (no ".."), or an absolute path; holds only this run's checkpoints.
    folder: str = "checkpoint"
    interval: int = 500  # steps between saves (also at the last step and on SIGTERM/SIGINT)
    keep_latest_k: int = 10  # newest checkpoints kept; 0 keeps all
    # "async": training goes on while the files are written; "disabled": blocks until written.
    async_mode: Literal["disabled", "async"] = "async"
    load_step: int = -1  # -1 = newest finalized
    # Multi-tier checkpoints (docs/CHECKPOINTS.md): a local tier on each host's own fast
    # storage (a RAM disk or local SSD, e.g. /dev/shm/NAME), saved every local_interval steps
    # between the persistent saves above; an absolute path outside checkpoint.folder, holding
    # one run's local checkpoints. "" = no local tier.
    local_folder: str = ""
    local_interval: int = 10  # steps between local-tier saves (keep it below `interval`)
    # Weights (or a whole state) a new run starts from: an orbax checkpoint folder or step, a
    # `titan-jax convert --to orbax` directory, or a HF directory (with initial_load_in_hf).
    initial_load_path: str = ""
    initial_load_in_hf: bool = False  # initial_load_path is a HF Qwen3 directory
    initial_load_model_only: bool = True  # load only the weights from an orbax initial_load_path
    last_save_model_only: bool = True  # the final checkpoint holds only the params
    last_save_in_hf: bool = False  # also write the final model as HF safetensors (hf-{step}/)
    export_dtype: Literal["float32", "bfloat16"] = "float32"  # of model-only and HF saves


@dataclasses.dataclass
class Moe:
    """Mixture-of-experts training knobs (MoE flavours only)."""

    # Aux-loss-free balancing (TorchTitan / DeepSeek-V3): each layer's expert bias moves by this
    # per optimizer step toward equal load; 0 turns it off.
    load_balance_coeff: float = 1e-3
    # HF's auxiliary load-balancing loss, added times this coefficient (0 = off, as TorchTitan).
    router_aux_loss_coef: float = 0.0


# The groups of matmuls `quantize.modules` names.
QUANTIZE_MODULES = ("attention", "mlp", "experts")


@dataclasses.dataclass
class Quantize:
    """Low-precision matmuls, quantized by qwix forward and backward; the weights, optimizer and
    checkpoints stay as they are (titan_jax/models/quantization.py, docs/NUMERICS.md)."""

    # fp8: e4m3 operands, e5m2 gradients (TPU7x, GPUs from Ada/Hopper); int8: both ways (TPU
    # v4-v6e). Other chips are refused in one line; CPU emulates both (tests).
    mode: Literal["none", "fp8", "int8"] = "none"
    # Comma-separated: attention (q/k/v/o projections), mlp (dense SwiGLU), experts (MoE
    # SwiGLU). The router, norms, attention scores and the output projection stay high.
    modules: str = "attention,mlp,experts"
    # Scale per row of each operand (rowwise), per operand (tensorwise), or per row and
    # `block_size` contracted elements (blockwise). Experts take rowwise only.
    scaling: Literal["rowwise", "tensorwise", "blockwise"] = "rowwise"
    block_size: int = 128  # blockwise: contracted elements per scale
    # How FSDP gathers the weights of quantized matmuls: auto: quantized on their shards and
    # gathered as codes and scales (1 byte an element; blockwise gathers the param dtype,
    # which qwix's backward re-reads); param_dtype: gathered, then quantized by the matmul.
    gather: Literal["auto", "param_dtype"] = "auto"

    def module_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.modules.split(",") if name.strip())


# What `lora.target_modules` can name: groups of projections, expanded to HF/PEFT's names of
# the Qwen3 projections, which may also be named one by one (the MoE experts' as the ends of
# PEFT's `target_parameters`: transformers fuses each layer's experts into two parameters).
LORA_GROUPS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "experts": ("experts.gate_up_proj", "experts.down_proj"),
}
LORA_TARGETS = (*LORA_GROUPS, *(n for names in LORA_GROUPS.values() for n in names))


@dataclasses.dataclass
class Lora:
    """LoRA fine-tuning (PEFT's): low-rank adapters beside the chosen projections are trained,
    the base weights stay frozen (titan_jax/models/lora.py, docs/POSTTRAINING.md)."""

    rank: int = 0  # the adapters' rank r; 0 = off (full fine-tuning)
    alpha: float = 8.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    # PEFT's lora_dropout: on the adapters' input, in training only, in [0, 1) (0 with experts)
    dropout: float = 0.0
    # Comma-separated: attention (q/k/v/o projections), mlp (the dense SwiGLU's gate/up/down),
    # experts (each MoE expert's gate+up and down), and/or HF/PEFT names q_proj, k_proj,
    # v_proj, o_proj, gate_proj, up_proj, down_proj, experts.gate_up_proj, experts.down_proj.
    # The default is PEFT's for Qwen3.
    target_modules: str = "q_proj,v_proj"
    # How the frozen base weights are stored: auto (training.mixed_precision_param as
    # resolved: bf16 on TPU/GPU, fp32 on CPU), float32, bfloat16, or quantized as QLoRA:
    # int8, fp8 (e4m3) or nf4 (the projections and experts; embeddings, norms and the router
    # then stay bf16). Quantized by qwix after init and after loading.
    base_dtype: Literal["auto", "float32", "bfloat16", "int8", "fp8", "nf4"] = "auto"
    base_block_size: int = 64  # nf4: input elements per scale (QLoRA's 64)

    def target_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.target_modules.split(",") if name.strip())

    def projections(self) -> tuple[str, ...]:
        """The HF/PEFT names of the projections the targets cover, groups expanded."""
        names = (n for t in self.target_names() for n in LORA_GROUPS.get(t, (t,)))
        return tuple(dict.fromkeys(names))


@dataclasses.dataclass
class Dpo:
    """Direct Preference Optimization (TRL's DPOTrainer) on preference pairs
    (training.data_format = "preference"); the reference model is the frozen base (with LoRA:
    the adapters off), docs/POSTTRAINING.md."""

    enable: bool = False  # train with the DPO loss; needs training.data_format = "preference"
    beta: float = 0.1  # how far the policy may move from the reference (TRL's beta)
    # "sigmoid" (DPO: -log sigmoid(beta x the log-ratio margin)) | "ipo" (IPO: the squared
    # distance of the length-averaged margin from 1 / (2 beta)), as TRL 1.16 computes them.
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"


@dataclasses.dataclass
class Metrics:
    log_freq: int = 10  # log every N steps (and the first and last)
    enable_tensorboard: bool = False  # TensorBoard scalars (tensorboardX)
    save_tb_folder: str = "tb"  # under job.dump_folder
    progress_bar: bool = True  # live tqdm bar; the per-step log lines print either way
    plot_loss: bool = True  # draw loss.png (matplotlib) at the end; off for many short runs
    # Per-layer RMS of the residual stream (`activation_rms`), through the model's aux channel.
    log_activation_stats: bool = False
    # Weights & Biases (the `wandb` extra); WANDB_PROJECT names the project, WANDB_MODE=offline
    # logs without a network.
    enable_wandb: bool = False
    # MFU denominator per device in FLOP/s; None = the published bf16 peak of a known TPU/GPU,
    # or a matmul peak measured at the start of the run on CPU (see train/peak_flops.py).
    peak_flops: float | None = None


@dataclasses.dataclass
class Validation:
    """Held-out loss during training (TorchTitan's [validation] keys)."""

    enable: bool = False  # evaluate a held-out loss during training
    # "pydoc": the embedded corpus's held-out slice (training never sees it); "tokens": a
    # held-out token store at dataset_path; a file source ("text", "jsonl", "parquet",
    # "hf_disk", with dataset_path) is prepared into a store and read whole, in order.
    dataset: Literal["tokens", "pydoc", "text", "jsonl", "parquet", "hf_disk"] = "pydoc"
    dataset_path: str = ""  # store folder(s) for "tokens"; file, directory or glob of files
    freq: int = 500  # validate every N steps, and at the last step
    steps: int = -1  # batches per validation; -1 = the whole validation set once
    local_batch_size: int = 8  # sequences per data-parallel rank per validation batch
    seq_len: int = 2048  # tokens per validation sequence


@dataclasses.dataclass
class Profiling:
    """jax.profiler traces (TensorBoard / Perfetto) in {dump_folder}/{save_traces_folder}."""

    enable_profiling: bool = False  # jax.profiler traces of selected steps
    save_traces_folder: str = "profile"  # under job.dump_folder
    profile_freq: int = 10  # trace the last `profile_steps` steps of every `profile_freq`
    profile_steps: int = 1  # steps traced per window


@dataclasses.dataclass
class Distributed:
    """Multi-process (multi-host) runs: `jax.distributed.initialize` before any device is used.

    Explicit: the same command on every host with `num_processes` > 1, the same
    `coordinator_address` (host:port of process 0) and each host's own `process_id`. Unset
    (the defaults): one process, except on TPU hosts, where JAX detects the cluster (TPU VMs,
    GKE, multislice) unless the environment names a single host.
    """

    coordinator_address: str = ""  # "host:port" of process 0; "" = auto-detect
    num_processes: int = -1  # -1 = auto-detect (TPU hosts; 1 elsewhere); 1 = never initialize
    process_id: int = -1  # this process's index in [0, num_processes); -1 = auto-detect
    # Seconds to wait for every process to reach the coordinator before failing.
    initialization_timeout: int = 300
    # Seconds a training step may take (after the first, which compiles; validations and
    # saves not counted) before the job is ended as hung: a stuck collective or a dead host,
    # as TorchTitan's comm.train_timeout_seconds. 0 = wait forever.
    step_timeout: int = 600
    # Seconds a process may go without a heartbeat (stopped, killed or cut off from the others)
    # before the rest end the job with a line naming it (exit code 3).
    heartbeat_timeout: int = 100


@dataclasses.dataclass
class JobConfig:
    job: Job = dataclasses.field(default_factory=Job)
    model: Model = dataclasses.field(default_factory=Model)
    training: Training = dataclasses.field(default_factory=Training)
    parallelism: Parallelism = dataclasses.field(default_factory=Parallelism)
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = dataclasses.field(default_factory=LRScheduler)
    activation_checkpoint: ActivationCheckpoint = dataclasses.field(
        default_factory=ActivationCheckpoint
    )
    checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
    moe: Moe = dataclasses.field(default_factory=Moe)
    quantize: Quantize = dataclasses.field(default_factory=Quantize)
    lora: Lora = dataclasses.field(default_factory=Lora)
    dpo: Dpo = dataclasses.field(default_factory=Dpo)
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    validation: Validation = dataclasses.field(default_factory=Validation)
    profiling: Profiling = dataclasses.field(default_factory=Profiling)
    distributed: Distributed = dataclasses.field(default_factory=Distributed)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The resolved config as TOML (None values are omitted: TOML has no null)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is not None:
                    lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, list):  # of tables: an inline array of inline tables
        return (
            "["
            + ", ".join(
                "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in t.items()) + "}"
                for t in value
            )
            + "]"
        )
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
