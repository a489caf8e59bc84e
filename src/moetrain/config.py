"""The job configuration: one typed section per component, loaded from TOML or JSON, overridden from the CLI.

A job file looks like::

    [model]
    preset = "tiny"          # start from a preset (or hf_config = "path/to/config.json"), then override fields
    dim = 192

    [parallel]
    ep = 2

    [data]
    paths = ["corpus/*.jsonl"]
    seq_len = 512

    [train]
    steps = 1000
    lr = 3e-3

Command-line overrides use the same dotted names: ``--set train.lr=1e-3 --set model.top_k=2``. An unknown section
or field fails at once with the list of valid names; ``moetrain train --help-config`` lists every field with its type,
default and meaning, read from the dataclasses' docstrings (:func:`field_docs`, the one source of them).

Defaults, in increasing precedence: the dataclasses, then the preset's training defaults
(:data:`moetrain.model.config.PRESET_JOB_DEFAULTS`: sequence length, batch, learning rate, EP), then the job file,
then ``--set``. Two values are derived unless set: ``data.vocab_size`` (a trained BPE's size) is the model's
vocabulary, and ``model.vocab_size`` follows the tokenizer (``data.tokenizer``'s size, or ``data.vocab_size`` for a
trained BPE), padded to a multiple of :data:`VOCAB_MULTIPLE`. Given the world size, an unset ``parallel.ep`` is
lowered to the largest size that divides the world and the number of experts (the demo's EP 2 becomes 1 on one
process); a ``parallel.ep`` the user set must divide the world, or the error names the ``--ep`` values that do.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from moetrain.data.config import MIN_BPE_VOCAB, DataConfig
from moetrain.layout import LAYOUT_FIELDS, TRAINER_KEY_ALIASES, Schedule, translate_aliases
from moetrain.model.config import PRESET_JOB_DEFAULTS, PRESETS, ConfigError, ModelConfig, from_dict_strict, get_preset
from moetrain.model.registry import spec_of_family
from moetrain.parallel.config import ParallelConfig, more_ranks
from moetrain.train.config import TrainConfig

SECTIONS = ("model", "parallel", "data", "train")
SECTION_CLASSES: dict[str, type] = {"model": ModelConfig, "parallel": ParallelConfig, "data": DataConfig,
                                    "train": TrainConfig}
#: The model's vocabulary, when it follows the tokenizer, is the tokenizer's size rounded up to a multiple of this
#: (GEMM-friendly embedding and output-head shapes).
VOCAB_MULTIPLE = 64
#: The preset of ``moetrain train`` with no arguments: the built-in CPU demo.
DEMO_PRESET = "tiny"


def preset_job_defaults(preset: str, model: ModelConfig) -> dict[str, dict[str, Any]]:
    """The parallel/data/train defaults a model brings: its preset's row of ``PRESET_JOB_DEFAULTS`` (``"hf"`` for a
    model from a HF config, ``preset`` starting with ``hf:``), ``data.seq_len`` capped at ``model.max_seq_len``, and
    ``data.vocab_size`` (a trained BPE's size) equal to ``model.vocab_size`` (at least the 257 a byte-level BPE
    holds)."""
    row = PRESET_JOB_DEFAULTS["hf" if preset.startswith("hf:") else preset]
    out = {s: dict(row.get(s, {})) for s in ("parallel", "data", "train")}
    if "seq_len" in out["data"]:
        out["data"]["seq_len"] = min(out["data"]["seq_len"], model.max_seq_len)
    out["data"]["vocab_size"] = max(model.vocab_size, MIN_BPE_VOCAB)  # a byte-level BPE holds >= 257 tokens
    return out


def _demo_section(section: str) -> Any:
    model = get_preset(DEMO_PRESET)
    return SECTION_CLASSES[section](**preset_job_defaults(DEMO_PRESET, model)[section])


@dataclass
class JobConfig:
    """Everything a training job needs; the defaults are the built-in demo (tiny preset with its job defaults).

    ``preset`` records where the model section started from; ``notes`` are what :func:`build_job_config` decided on
    the user's behalf (e.g. a lowered EP), for the CLI to print; they are not part of the saved config."""

    model: ModelConfig = field(default_factory=lambda: get_preset(DEMO_PRESET))
    parallel: ParallelConfig = field(default_factory=lambda: _demo_section("parallel"))
    data: DataConfig = field(default_factory=lambda: _demo_section("data"))
    train: TrainConfig = field(default_factory=lambda: _demo_section("train"))
    preset: str = DEMO_PRESET
    notes: list[str] = field(default_factory=list, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, **{s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS},
                "model": self.model.to_dict()}


def _parse_value(text: str) -> Any:
    """TOML literal if it parses (numbers, booleans, strings in quotes, lists), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["train.lr=1e-3", "model.top_k=2"]`` -> ``{"train": {"lr": 0.001}, "model": {"top_k": 2}}``.

    Raises:
        ConfigError: an item without ``section.field=value`` or with an unknown section.
    """
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"override {item!r} must look like section.field=value, e.g. train.lr=1e-3")
        if section not in SECTIONS and section != "model":
            raise ConfigError(f"unknown config section {section!r} in {item!r}; sections: {list(SECTIONS)}")
        out.setdefault(section, {})[name] = _parse_value(value.strip())
    return out


def _merge(base: dict[str, dict[str, Any]], extra: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    merged = {k: dict(v) for k, v in base.items()}
    for section, values in extra.items():
        merged.setdefault(section, {}).update(values)
    return merged


def read_config_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML (.toml) or JSON (.json) job file into sections.

    Raises:
        ConfigError: missing file, parse error, or an unknown top-level section.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")  # TOML is UTF-8 by definition, whatever the locale
        raw = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot parse config file {str(p)!r}: {e}") from None
    unknown = sorted(set(raw) - set(SECTIONS) - {"preset"})
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown} in {str(p)!r}; sections: {list(SECTIONS)}")
    if "preset" in raw:
        raw.setdefault("model", {})["preset"] = raw.pop("preset")
    return raw


def pad_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``: the embedding rows for a tokenizer of ``n`` tokens."""
    return -(-n // multiple) * multiple


def fit_ep(preferred: int, world: int, n_experts: int) -> int:
    """The largest EP size <= ``preferred`` that divides both ``world`` and ``n_experts`` (1 at worst)."""
    return max(d for d in range(1, max(1, preferred) + 1) if world % d == 0 and n_experts % d == 0)


def _tokenizer_size(data: DataConfig) -> tuple[int, str]:
    """(tokens, where the number comes from) of the tokenizer ``data`` describes, without touching the corpus."""
    if data.tokenizer is None:
        return data.vocab_size, "the trained BPE (data.vocab_size)"
    from moetrain.data.tokenizer import load_tokenizer  # raises DataError naming the file and the fix

    tok = load_tokenizer(data.tokenizer, data.eos_token)
    return tok.vocab_size, f"the tokenizer {str(data.tokenizer)!r}"


def _resolve_vocab(model: ModelConfig, data: DataConfig, fixed_by: str | None) -> ModelConfig:
    """model.vocab_size follows the tokenizer (padded) unless ``fixed_by`` names who fixed it; then it must hold it."""
    n, source = _tokenizer_size(data)
    if fixed_by is None:
        return model.replace(vocab_size=pad_vocab(n)) if model.vocab_size != pad_vocab(n) else model
    if n > model.vocab_size:
        smaller = ("--tokenizer with at most that many tokens" if data.tokenizer is not None
                   else f"--set data.vocab_size={model.vocab_size} (a smaller BPE)")
        fix = (f"leave model.vocab_size unset to follow the tokenizer, set --set model.vocab_size={pad_vocab(n)}, "
               if fixed_by == "model.vocab_size" else "")
        raise ConfigError(f"{source} has {n} tokens but model.vocab_size is {model.vocab_size} (fixed by "
                          f"{fixed_by}); {fix}or use {smaller}")
    return model


def _resolve_ep(job: JobConfig, world: int, user_set: bool, dry_run_world: bool = False) -> None:
    """Fit parallel.ep to ``world`` (see the module docstring); a note says when an unset EP was lowered. Under
    pipelining EP is carved out of one stage's ranks (world / pp). ``dry_run_world``: ``world`` is a dry run's
    ``--world``, which the messages name."""
    ep, n_experts, pp = job.parallel.ep, job.model.n_routed_experts, job.parallel.pp
    ranks = f"--world {world}" if dry_run_world else f"the {world} process(es) of this run"
    if world % pp:
        raise ConfigError(f"parallel.pp={pp} does not divide {ranks}; {more_ranks(pp, dry_run_world)} or change --pp")
    stage = world // pp
    where = (f"the {stage} rank(s) of each pipeline stage ({ranks} / pp {pp})" if pp > 1 else ranks)
    if user_set:
        if stage % ep:
            ok = [d for d in range(1, stage + 1) if stage % d == 0 and n_experts % d == 0]
            raise ConfigError(f"parallel.ep={ep} does not divide {where}; use --ep {fit_ep(ep, stage, n_experts)} "
                              f"(allowed here: {', '.join(map(str, ok))}), or "
                              f"{more_ranks(pp * ep, dry_run_world)}{' (pp x ep)' if pp > 1 else ''}")
        return
    fit = fit_ep(ep, stage, n_experts)
    if fit != ep:
        job.parallel = dataclasses.replace(job.parallel, ep=fit)
        job.notes.append(f"parallel.ep={fit}: the {job.preset} preset's default EP {ep} does not fit {where} and "
                         f"{n_experts} experts; --ep N chooses another")


def _pipeline_microbatches(job: JobConfig, mbs_set: bool) -> None:
    """An unset ``train.grad_accum`` under pipelining becomes the fewest micro-batches the schedule runs with (PP;
    DualPipeV: PP x 2). An unset micro-batch size is split to keep the sequences per step where the split divides
    them; a set one is kept (the tokens per step then grow). The note says what changed: validation runs
    ``train.eval_batches`` micro-batches, so a smaller micro-batch also validates on fewer sequences."""
    pcfg, tc = job.parallel, job.train
    need = pcfg.n_stages if pcfg.schedule == Schedule.DUALPIPEV else pcfg.pp
    if tc.grad_accum >= need and (pcfg.schedule != Schedule.INTERLEAVED or tc.grad_accum % pcfg.pp == 0):
        return
    seqs = tc.micro_batch_size * tc.grad_accum
    split = not mbs_set and seqs % need == 0 and seqs >= need
    mbs = seqs // need if split else tc.micro_batch_size
    job.train = dataclasses.replace(tc, grad_accum=need, micro_batch_size=mbs)
    kept = (f"the {seqs} sequences per pipeline and step kept, validation on {tc.eval_batches} micro-batches of "
            f"{mbs}" if split else f"{mbs * need} sequences per pipeline and step (was {seqs})")
    job.notes.append(f"train.grad_accum={need}, train.micro_batch_size={mbs}: parallel.schedule="
                     f"{pcfg.schedule!r} at parallel.pp={pcfg.pp} needs {need} micro-batches per step ({kept}); "
                     f"--set train.grad_accum=N chooses another")


def _planned_split(job: JobConfig, world: int | None) -> None:
    """An unset ``parallel.pp_layout`` under pipelining becomes the planner's cost-balanced split of this job
    (:func:`moetrain.plan.local.default_split`); where it is not available a note says why (the layers are then
    split evenly)."""
    from moetrain.plan.local import default_split

    split, why = default_split(job.model, job.parallel, job.train.micro_batch_size, job.train.grad_accum,
                               job.data.seq_len, world)
    if split is None:
        job.notes.append(f"parallel.pp_layout: the layers are split evenly (the planner's cost-balanced split is "
                         f"not available here: {why})")
    else:
        job.parallel = job.parallel.replace(pp_layout=split)


def build_job_config(sections: dict[str, dict[str, Any]] | None = None,
                     world: int | Callable[[JobConfig], int | None] | None = None,
                     dry_run_world: bool = False) -> JobConfig:
    """Build a validated JobConfig from raw sections (file contents merged with overrides).

    ``model.preset`` (default "tiny") or ``model.hf_config`` (a HF config.json) gives the starting model; other
    ``model.*`` keys override its fields. Unset parallel/data/train fields take the preset's training defaults
    (:func:`preset_job_defaults`), then the dataclass defaults. ``model.vocab_size`` follows the tokenizer unless it
    is set (in the model section, or by a HF config); a tokenizer larger than a set vocabulary is an error.

    Args:
        sections: ``{section: {field: value}}``.
        world: the number of processes that will train (or a function of the preliminary job giving it, None if
            unknown): an unset ``parallel.ep`` is lowered to fit it, a set one must divide it. None: EP as given.
        dry_run_world: ``world`` is the ``--world`` of a dry run (the messages name that option, not --nproc).

    Raises:
        ConfigError / ValueError: naming the offending field and the fix. DataError: ``data.tokenizer`` cannot be
        loaded (it is read to size the model's vocabulary).
    """
    sections = translate_aliases(sections or {})
    model_raw = sections.get("model", {})
    preset = model_raw.pop("preset", None)
    hf_config = model_raw.pop("hf_config", None)
    family = model_raw.get("family")
    init_from = sections.get("train", {}).get("init_from")
    if init_from is not None:
        init = Path(str(init_from))
        if not (init / "config.json").is_file():
            raise ConfigError(f"train.init_from={str(init)!r} is not a HF checkpoint directory (no config.json "
                              f"there); give the directory holding config.json and the safetensors files")
        if preset is None and hf_config is None:
            hf_config = str(init / "config.json")  # the architecture comes with the weights
        data_raw = sections.setdefault("data", {})
        if (init / "tokenizer.json").is_file() and not data_raw.get("tokenizer"):
            data_raw["tokenizer"] = str(init / "tokenizer.json")  # and the token ids the weights were trained on
    if hf_config is not None:
        from moetrain.interop.hf import load_hf_config
        base = load_hf_config(hf_config)
        preset = f"hf:{hf_config}"
    else:
        # a model section of another family without a preset (a saved run of a model read from a HF config)
        # starts from that family's demo preset
        preset = preset or (DEMO_PRESET if family is None else spec_of_family(family).demo_preset)
        base = get_preset(preset)
    model = base.replace(**model_raw) if model_raw else base
    defaults = preset_job_defaults(preset, model)
    parallel = from_dict_strict(ParallelConfig, {**defaults["parallel"], **sections.get("parallel", {})},
                                "parallel")
    data = from_dict_strict(DataConfig, {**defaults["data"], **sections.get("data", {})}, "data")
    try:
        data.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    train = from_dict_strict(TrainConfig, {**defaults["train"], **sections.get("train", {})}, "train")
    if data.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len={data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; lower "
                          f"--set data.seq_len= or raise --set model.max_seq_len=")
    fixed_by = ("model.vocab_size" if "vocab_size" in model_raw
                else f"the HF config {hf_config}" if hf_config is not None else None)
    model = _resolve_vocab(model, data, fixed_by)
    job = JobConfig(model=model, parallel=parallel, data=data, train=train, preset=preset)
    if parallel.pp > 1 and "grad_accum" not in sections.get("train", {}):
        _pipeline_microbatches(job, "micro_batch_size" in sections.get("train", {}))
    if parallel.ep_overlap and job.train.grad_accum < 2 and parallel.pp == 1:
        job.notes.append("parallel.ep_overlap pairs micro-batch i+1's forward with micro-batch i's backward; with "
                         "train.grad_accum=1 nothing pairs and only the delayed weight gradients hide the backward "
                         "all-to-alls (--set train.grad_accum=2 or more)")
    late = [n for n in train.profile_steps if n > train.steps]
    if late:
        job.notes.append(f"train.profile_steps {late} lie past train.steps={train.steps}: no trace is written for them")
    if callable(world):
        world = world(job)
    if world is not None and world >= 1:
        _resolve_ep(job, world, user_set="ep" in sections.get("parallel", {}), dry_run_world=dry_run_world)
    if job.parallel.pp > 1 and job.parallel.pp_layout is None:
        _planned_split(job, world)
    if job.parallel.ep_overlap and job.parallel.ep == 1:
        job.notes.append("parallel.ep_overlap at parallel.ep=1: there is no expert all-to-all to hide (the paired "
                         "schedule still runs, with its delayed weight gradients)")
    return job


def load_job_config(path: str | Path | None = None, overrides: list[str] | None = None,
                    world: int | Callable[[JobConfig], int | None] | None = None,
                    plan: dict[str, dict[str, Any]] | None = None, dry_run_world: bool = False) -> JobConfig:
    """File (optional), then a plan's sections (``plan``, from :func:`moetrain.train.from_plan.plan_job`), then
    ``section.field=value`` overrides -> validated JobConfig (``world``, ``dry_run_world``: see
    :func:`build_job_config`). Each source's
    older key names are translated on its own, so a newer name in one and an older in the next override each other."""
    sections = translate_aliases(read_config_file(path)) if path else {}
    sections = _merge(sections, plan or {})
    given = parse_overrides(overrides or [])
    if plan:
        layout_keys = {("parallel", k) for k in LAYOUT_FIELDS} | set(TRAINER_KEY_ALIASES)
        fixed = sorted(f"{s}.{k}" for s, sec in given.items() for k in sec if (s, k) in layout_keys)
        if fixed:
            raise ConfigError(f"--plan fixes the layout, and --set / --ep / --pp would change "
                              f"{', '.join(fixed)}: the run would not be the plan; change the "
                              f"plan (moetrain plan ... --json) or drop --plan")
    if "dedup" in given.get("parallel", {}) and "dispatcher" in sections.get("parallel", {}):
        # dedup = true reads as "the default dispatcher", which cannot undo a dispatcher the file set
        raise ConfigError("parallel.dedup (the older name of parallel.dispatcher) cannot override the "
                          "parallel.dispatcher of the config file; set --set parallel.dispatcher=flex or alltoall")
    return build_job_config(_merge(sections, translate_aliases(given)), world, dry_run_world)


def save_job_config(job: JobConfig, path: str | Path) -> Path:
    """Write ``job`` as TOML (``.toml``) or JSON (any other suffix); ``load_job_config`` reads it back."""
    p = Path(path)
    d = job.to_dict()
    preset = d.pop("preset")
    d["model"] = {"preset": preset, **d["model"]} if not preset.startswith("hf:") else d["model"]
    if p.suffix == ".toml":
        from moetrain.toml_write import dumps

        def drop_none(x: Any) -> Any:  # TOML has no null: an absent key means the default (None)
            if isinstance(x, list):  # data.sources: a list of tables
                return [drop_none(v) for v in x]
            return {k: drop_none(v) for k, v in x.items() if v is not None} if isinstance(x, dict) else x
        p.write_text(dumps(drop_none(d)), encoding="utf-8")
    else:
        p.write_text(json.dumps(d, indent=2), encoding="utf-8")
    return p


def job_config_from_dict(d: dict[str, Any]) -> JobConfig:
    """Inverse of JobConfig.to_dict (used to ship the config to worker processes)."""
    d = {**d, **translate_aliases({s: d[s] for s in ("parallel", "train")})}
    return JobConfig(model=ModelConfig.from_dict(d["model"]), parallel=ParallelConfig(**d["parallel"]),
                     data=DataConfig(**d["data"]), train=TrainConfig(**d["train"]), preset=d.get("preset", "tiny"))


# ---- discoverable settings -------------------------------------------------------------------------------------

_ENTRY = re.compile(r"([a-z_][a-z0-9_]*(?:\s*[/,]\s*[a-z_][a-z0-9_]*)*):\s+(.*)")
_INLINE = re.compile(r"(?<=\.)\s+([a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*):\s+")

#: Job-level rules that the dataclass docstrings cannot know (they come from :func:`build_job_config`).
JOB_NOTES = {
    "model.vocab_size": "unset: follows the tokenizer, padded to a multiple of 64",
    "parallel.ep": "unset: the preset's, lowered to divide the world and the experts",
}
#: The model section's keys that are not ModelConfig fields.
MODEL_SOURCES = {
    "preset": ("str", "the preset the model section starts from: " + ", ".join(PRESETS)),
    "hf_config": ("str | None", "a HF config.json to take the architecture from instead of a preset (also implied "
                                "by train.init_from)"),
}


def field_docs(cls: type) -> dict[str, str]:
    """The meaning of each field of dataclass ``cls``, read from the ``Attributes:`` section of its docstring.

    An entry is ``name: text`` (continuation lines indented deeper); ``a / b / c: text`` and ``a, b: text`` give the
    same text to several fields, and ``a: text. b: text`` on one line are two entries. Fields the docstring does not
    describe are absent (the tests require every field to be described).
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Attributes")) + 1
    except StopIteration:
        return {}
    entries: list[tuple[list[str], list[str]]] = []
    indent = None
    for line in lines[start:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break
        indent = depth if indent is None else indent
        m = _ENTRY.fullmatch(line.strip()) if depth == indent else None
        names = re.split(r"\s*[/,]\s*", m.group(1)) if m else []
        if m and set(names) <= fields:
            entries.append((names, [m.group(2)]))
        elif entries:
            entries[-1][1].append(line.strip())
    out: dict[str, str] = {}
    for names, parts in entries:
        text = " ".join(parts)
        while True:  # "a: one. b: two" -> two entries
            m = next((m for m in _INLINE.finditer(text)
                      if set(re.split(r"\s*/\s*", m.group(1))) <= fields), None)
            if m is None:
                break
            for n in names:
                out[n] = text[:m.start()].strip()
            names, text = re.split(r"\s*/\s*", m.group(1)), text[m.end():]
        for n in names:
            out[n] = text.strip()
    return out


def _first_sentence(text: str) -> str:
    """Up to the first full stop outside brackets that ends a sentence (not "e.g." / "i.e.")."""
    depth = 0
    for i, c in enumerate(text):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "." and depth <= 0 and (i + 1 == len(text) or text[i + 1] in " \n") and text[i - 1:i] != ".":
            if not re.search(r"(?:\be\.g|\bi\.e|\betc|\bvs)$", text[:i]):
                return text[:i + 1]
    return text


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def format_value(v: Any) -> str:
    """A value as it is written after ``--set section.field=`` (TOML): true/false, quoted strings, lists; None is
    shown as ``unset``."""
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, list, tuple)):
        return json.dumps(v)
    return repr(v)


def describe_config(job: JobConfig | None = None, section: str | None = None) -> str:
    """The text of ``moetrain train --help-config``: every section and field with its type, its value in ``job``
    (default: the built-in demo job) and its meaning; one line per field, or the full meaning for one ``section``.

    Raises:
        ConfigError: ``section`` is not one of :data:`SECTIONS`.
    """
    if section is not None and section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}; sections: {', '.join(SECTIONS)}")
    job = job or JobConfig()
    full = section is not None
    out = [f"Job settings: --set SECTION.FIELD=VALUE (repeatable) or a [SECTION] table in --config FILE. The value "
           f"column is this job's (preset {job.preset}; --preset/--config/--set change it)."]
    if not full:
        out.append("`--help-config SECTION` prints the full meaning of each field of one section.")
    for name in (section,) if full else SECTIONS:
        cls = SECTION_CLASSES[name]
        docs = field_docs(cls)
        if name == "model":  # the job's family: the common fields and its own
            cls = type(job.model)
            docs = {**docs, **field_docs(cls)}
        hints = typing.get_type_hints(cls)
        values = dataclasses.asdict(getattr(job, name))
        rows = [(f.name, _type_name(hints[f.name]), format_value(values[f.name]),
                 docs.get(f.name, "").replace("``", "")) for f in dataclasses.fields(cls)]
        if name == "model":
            src = job.preset[3:] if job.preset.startswith("hf:") else None
            rows = [("preset", MODEL_SOURCES["preset"][0], format_value(None if src else job.preset),
                     MODEL_SOURCES["preset"][1]),
                    ("hf_config", MODEL_SOURCES["hf_config"][0], format_value(src), MODEL_SOURCES["hf_config"][1]),
                    *rows]
        out.append("")
        summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        out.append(f"[{name}]  --set {name}.FIELD=VALUE  -- {_first_sentence(summary)}")
        width = max(len(f"{name}.{r[0]}") for r in rows)
        twidth = min(30, max(len(r[1]) for r in rows))
        vwidth = min(16, max(len(r[2]) for r in rows))
        for fname, tname, value, doc in rows:
            key = f"{name}.{fname}"
            note = JOB_NOTES.get(key)
            if full:
                out.append(f"  {key}: {tname} = {value}")
                text = doc + (f" [{note}]" if note else "")
                out.extend(textwrap.wrap(text, 112, initial_indent="      ", subsequent_indent="      "))
            else:
                text = _first_sentence(doc) + (f" [{note}]" if note else "")
                out.append(f"  {key:<{width}}  {tname:<{twidth}}  {value:<{vwidth}}  {text}")
    return "\n".join(out)
