"""Hypothesis strategies for the config space that matters, kept in one module (as attrs does)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

ESTIMATORS = ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


@st.composite
def config_dicts(draw: st.DrawFn, *, eval_data: bool | None = None, save: bool | None = None) -> dict[str, Any]:
    """Nested config data (as a TOML file would give) over the settings that decide the plan and
    the loop: counts from 0 up (including invalid ones), critic, estimator, KL, warmup/decay,
    batch sizes, eval and save intervals, start_rollout_id."""
    small = st.integers(min_value=-1, max_value=6)
    n_samples = draw(st.integers(min_value=0, max_value=4))
    rollout_batch = draw(st.integers(min_value=0, max_value=4))
    samples = max(n_samples * rollout_batch, 1)
    global_batch = draw(st.one_of(st.sampled_from(sorted({d for d in range(1, samples + 1) if samples % d == 0})), small))
    has_eval = draw(st.booleans()) if eval_data is None else eval_data
    has_save = draw(st.booleans()) if save is None else save
    data: dict[str, Any] = {
        "rollout": {
            "num_rollout": draw(st.one_of(st.integers(min_value=-1, max_value=6), st.just(0))),
            "rollout_batch_size": rollout_batch,
            "n_samples_per_prompt": n_samples,
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
        st.text(max_size=5), st.floats(allow_nan=True), st.booleans(), st.none(),
        st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
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
    start_rollout_id), so properties about plans and runs are not starved by filtering."""
    estimator = draw(st.sampled_from(ESTIMATORS))
    group_based = estimator in ("grpo", "reinforce_plus_plus_baseline")
    n_samples = draw(st.integers(min_value=2 if group_based else 1, max_value=4))
    rollout_batch = draw(st.integers(min_value=1, max_value=4))
    prompts_per_step = draw(st.sampled_from([d for d in range(1, rollout_batch + 1) if rollout_batch % d == 0]))
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
        "rollout": {"num_rollout": num_rollout, "rollout_batch_size": rollout_batch, "n_samples_per_prompt": n_samples},
        "algorithm": {
            "advantage_estimator": estimator,
            "use_critic": draw(st.booleans()),
            "kl_coef": draw(st.sampled_from([0.0, 0.0, 0.05])),
            "use_kl_loss": draw(st.booleans()),
            "kl_loss_coef": draw(st.sampled_from([0.0, 0.01])),
            "kl_loss_type": draw(st.sampled_from(KL_TYPES)),
            "sft_warmup_rollouts": draw(st.integers(min_value=0, max_value=max(num_rollout - 1, 0))),
        },
        "optim": {"lr": 1e-5, "lr_warmup_iters": warmup, "lr_decay_style": draw(st.sampled_from(["constant", "linear", "cosine"]))},
        "train": {"global_batch_size": global_batch, "micro_batch_size": micro},
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
    return data
