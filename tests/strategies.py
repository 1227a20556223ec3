"""Hypothesis strategies, kept in one module (as attrs does): the config space that matters, and
ragged samples, padded float rows and groups for the algorithm tests."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from rlcore.samples import Generation, Prompt, Sample
from rlcore.specs import GROUPED_ESTIMATORS, AdvantageEstimator

ESTIMATORS: tuple[AdvantageEstimator, ...] = (
    "grpo",
    "gspo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
)
AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-budget")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


@st.composite
def config_dicts(
    draw: st.DrawFn, *, eval_data: bool | None = None, save: bool | None = None
) -> dict[str, Any]:
    """Nested config data (as a TOML file would give) over the settings that decide the plan and
    the loop: counts from 0 up (including invalid ones), critic, estimator, KL, warmup/decay,
    batch sizes, eval and save intervals, start_rollout_id."""
    small = st.integers(min_value=-1, max_value=6)
    n_samples = draw(st.integers(min_value=0, max_value=4))
    rollout_batch = draw(st.integers(min_value=0, max_value=4))
    samples = max(n_samples * rollout_batch, 1)
    global_batch = draw(
        st.one_of(
            st.sampled_from(sorted({d for d in range(1, samples + 1) if samples % d == 0})), small
        )
    )
    has_eval = draw(st.booleans()) if eval_data is None else eval_data
    has_save = draw(st.booleans()) if save is None else save
    data: dict[str, Any] = {
        "rollout": {
            "num_rollout": draw(st.one_of(st.integers(min_value=-1, max_value=6), st.just(0))),
            "rollout_batch_size": rollout_batch,
            "n_samples_per_prompt": n_samples,
            "temperature": draw(st.sampled_from([1.0, 1.0, 0.7, 0.0, -0.5])),
        },
        "algorithm": {
            "advantage_estimator": draw(st.sampled_from(ESTIMATORS)),
            "use_critic": draw(st.booleans()),
            "kl_coef": draw(st.sampled_from([0.0, 0.0, 0.05, -0.1])),
            "use_kl_loss": draw(st.booleans()),
            "kl_loss_coef": draw(st.sampled_from([0.0, 0.01])),
            "kl_loss_type": draw(st.sampled_from(KL_TYPES)),
        },
        "optim": {
            "lr": draw(st.sampled_from([1e-5, 1e-6, 0.0])),
            "lr_warmup_iters": draw(st.integers(min_value=-1, max_value=8)),
            "lr_decay_iters": draw(st.one_of(st.none(), st.integers(min_value=-1, max_value=10))),
            "lr_decay_style": draw(st.sampled_from(["constant", "linear", "cosine"])),
        },
        "train": {
            "global_batch_size": global_batch,
            "micro_batch_size": draw(st.sampled_from([1, 1, 2, 3])),
        },
        "eval": {
            "interval": draw(st.one_of(st.none(), small)),
            "skip_eval_before_train": draw(st.booleans()),
        },
        "checkpoint": {
            "save_interval": draw(st.one_of(st.none(), small)),
            "start_rollout_id": draw(st.one_of(st.none(), st.none(), small)),
        },
        "seed": draw(st.integers(min_value=0, max_value=2**31)),
    }
    for section in ("optim", "eval", "checkpoint"):
        data[section] = {k: v for k, v in data[section].items() if v is not None}
    if has_eval:
        data["eval"]["prompt_data"] = [{"name": "heldout", "path": "heldout.jsonl"}]
    if has_save:
        data["checkpoint"]["save"] = "ckpt"
    return data


def junk() -> st.SearchStrategy[Any]:
    """Values of the wrong type or shape, to mix into config data."""
    return st.one_of(
        st.text(max_size=5),
        st.floats(allow_nan=True),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )


@st.composite
def corrupted_config_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A config dict with one value replaced by junk or one unknown key added."""
    data = draw(config_dicts())
    section = draw(st.sampled_from(sorted(k for k, v in data.items() if isinstance(v, dict))))
    if draw(st.booleans()) and data[section]:
        key = draw(st.sampled_from(sorted(data[section])))
        data[section][key] = draw(junk())
    else:
        data[section][draw(st.text(min_size=1, max_size=8))] = draw(junk())
    return data


@st.composite
def valid_config_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """Config data that is valid by construction, over the same settings as :func:`config_dicts`
    (num_rollout from 0, critic, estimator, KL, warmup/decay, batch split, eval/save intervals,
    start_rollout_id) and the rollout/loss variants (over-sampling, the reward-std filter, kept
    surplus, loss aggregation, TIS or rollout log-probs), so properties about plans and runs are
    not starved by filtering."""
    estimator = draw(st.sampled_from(ESTIMATORS))
    group_based = estimator in GROUPED_ESTIMATORS
    n_samples = draw(st.integers(min_value=2 if group_based else 1, max_value=4))
    rollout_batch = draw(st.integers(min_value=1, max_value=4))
    prompts_per_step = draw(
        st.sampled_from([d for d in range(1, rollout_batch + 1) if rollout_batch % d == 0])
    )
    global_batch = n_samples * prompts_per_step
    micro = draw(st.sampled_from([d for d in range(1, global_batch + 1) if global_batch % d == 0]))
    num_rollout = draw(st.integers(min_value=0, max_value=6))
    total_steps = num_rollout * (rollout_batch // prompts_per_step)
    decay_iters = draw(st.one_of(st.none(), st.integers(min_value=1, max_value=12)))
    decay = decay_iters if decay_iters is not None else total_steps
    warmup = draw(st.integers(min_value=0, max_value=max(decay - 1, 0)))
    eval_interval = draw(st.one_of(st.none(), st.integers(min_value=1, max_value=4)))
    has_eval = num_rollout == 0 or eval_interval is not None or draw(st.booleans())
    save_interval = draw(st.one_of(st.none(), st.integers(min_value=1, max_value=4)))
    has_save = save_interval is not None or draw(st.booleans())
    start = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=max(num_rollout - 1, 0))))
    data: dict[str, Any] = {
        "rollout": {
            "num_rollout": num_rollout,
            "rollout_batch_size": rollout_batch,
            "n_samples_per_prompt": n_samples,
            "temperature": draw(st.sampled_from([1.0, 0.7, 1.3, 0.0])),
        },
        "algorithm": {
            "advantage_estimator": estimator,
            "use_critic": draw(st.booleans()),
            "kl_coef": draw(st.sampled_from([0.0, 0.0, 0.05])),
            "use_kl_loss": draw(st.booleans()),
            "kl_loss_coef": draw(st.sampled_from([0.0, 0.01])),
            "kl_loss_type": draw(st.sampled_from(KL_TYPES)),
            "sft_warmup_rollouts": draw(st.integers(min_value=0, max_value=num_rollout)),
            "normalize_std": draw(st.booleans()),
            "normalize_advantages": draw(st.booleans()),
        },
        "optim": {
            "lr": 1e-5,
            "lr_warmup_iters": warmup,
            "lr_decay_style": draw(st.sampled_from(["constant", "linear", "cosine"])),
            "use_distributed_optimizer": draw(st.booleans()),
        },
        "train": {"global_batch_size": global_batch, "micro_batch_size": micro},
        "model": {"bf16": draw(st.booleans())},
        "eval": {"skip_eval_before_train": draw(st.booleans())},
        "checkpoint": {},
        "seed": draw(st.integers(min_value=0, max_value=2**31)),
    }
    if decay_iters is not None:
        data["optim"]["lr_decay_iters"] = decay_iters
    if eval_interval is not None:
        data["eval"]["interval"] = eval_interval
    if has_eval:
        data["eval"]["prompt_data"] = [{"name": "heldout", "path": "heldout.jsonl"}]
    if save_interval is not None:
        data["checkpoint"]["save_interval"] = save_interval
    if has_save:
        data["checkpoint"]["save"] = "ckpt"
    if start is not None and num_rollout > 0:
        data["checkpoint"]["start_rollout_id"] = start
    over_sampling = draw(st.one_of(st.none(), st.integers(rollout_batch, rollout_batch + 3)))
    if over_sampling is not None:
        data["rollout"]["over_sampling_batch_size"] = over_sampling
        data["rollout"]["over_sampling_surplus"] = draw(st.sampled_from(["drop", "keep"]))
    if n_samples >= 2 and draw(st.booleans()):  # a group of one never passes the filter
        data["rollout"]["dynamic_sampling_filter_path"] = "rlcore.rollout:check_reward_nonzero_std"
    data["algorithm"]["loss_agg_mode"] = draw(st.sampled_from(AGG_MODES))
    correction = draw(st.sampled_from(["none", "tis", "rollout_logprobs"]))
    if correction == "tis":
        data["algorithm"]["use_tis"] = True
        data["algorithm"]["tis_mode"] = draw(st.sampled_from(["clip", "mask"]))
        data["algorithm"]["tis_level"] = draw(st.sampled_from(["token", "geometric"]))
    elif correction == "rollout_logprobs":
        data["algorithm"]["use_rollout_logprobs"] = True
    return data


# --- algorithms: samples, per-token rows, groups
VOCAB = 16

finite = st.floats(-5.0, 5.0, allow_nan=False, width=32)
log_prob = st.floats(-8.0, 0.0, allow_nan=False, width=32)


@st.composite
def samples(
    draw: st.DrawFn, min_size: int = 1, max_size: int = 6, max_response: int = 5
) -> list[Sample]:
    """Samples with prompts of 1-4 tokens and responses of 0..max_response tokens."""
    n = draw(st.integers(min_size, max_size))
    out = []
    for i in range(n):
        prompt = tuple(draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4)))
        response = tuple(draw(st.lists(st.integers(1, VOCAB - 1), max_size=max_response)))
        lps = tuple(draw(st.lists(log_prob, min_size=len(response), max_size=len(response))))
        reward = draw(st.floats(-2.0, 2.0, allow_nan=False))
        out.append(
            Sample(
                prompt=Prompt(index=i, text="", token_ids=prompt),
                response=Generation(token_ids=response, log_probs=lps, text=""),
                reward=reward,
                group=i,
            )
        )
    return out


@st.composite
def grouped_samples(
    draw: st.DrawFn, max_groups: int = 4, max_group_size: int = 5
) -> tuple[list[Sample], int]:
    """Consecutive groups of samples sharing a group id, and the group size."""
    group_size = draw(st.integers(1, max_group_size))
    n_groups = draw(st.integers(1, max_groups))
    flat = draw(samples(min_size=group_size * n_groups, max_size=group_size * n_groups))
    regrouped = [
        Sample(prompt=s.prompt, response=s.response, reward=s.reward, group=i // group_size)
        for i, s in enumerate(flat)
    ]
    return regrouped, group_size


def rows_for(
    data: st.DataObject, batch: list[Sample], elements: st.SearchStrategy[float] = finite
) -> tuple[tuple[float, ...], ...]:
    """One float row per sample, as long as its response."""
    lengths = [len(s.response.token_ids) for s in batch]
    return tuple(tuple(data.draw(st.lists(elements, min_size=n, max_size=n))) for n in lengths)


@st.composite
def masked_floats(
    draw: st.DrawFn, max_b: int = 5, max_t: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 ``[B, T]`` tensor and a right-padded mask with at least one True per row."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
    values = draw(st.lists(finite, min_size=b * t, max_size=b * t))
    x = torch.tensor(values, dtype=torch.float64).reshape(b, t)
    mask = torch.tensor([[j < n for j in range(t)] for n in lengths])
    return x, mask


@st.composite
def padded_episodes(
    draw: st.DrawFn, max_b: int = 4, max_t: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(response, mask)``, both ``BoolTensor[B, T]``: each row's response is a prefix of the
    width (0 to ``T`` tokens: an empty response too), and ``mask`` is True on its model tokens,
    False on padding and on a multi-turn episode's environment tokens, in any order (a row may
    have none: a response of observations only)."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    responses, masks = [], []
    for _ in range(b):
        n = draw(st.integers(0, t))
        multiturn = draw(st.booleans())
        row = draw(st.lists(st.booleans(), min_size=n, max_size=n)) if multiturn else [True] * n
        responses.append([True] * n + [False] * (t - n))
        masks.append(row + [False] * (t - n))
    return torch.tensor(responses, dtype=torch.bool), torch.tensor(masks, dtype=torch.bool)


def tensor_like(data: st.DataObject, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """A float64 tensor of ``mask``'s shape with entries drawn from ``[low, high]``."""
    n = mask.numel()
    values = data.draw(st.lists(st.floats(low, high, allow_nan=False), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float64).reshape(mask.shape)
