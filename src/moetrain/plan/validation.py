"""The validation set: published MoE training throughputs the model was NOT calibrated on, and its report.

Rules (issue "moetrain plan must generalise"): every point is a public figure with its source; the plan of each
point is the published layout plus the published recipe's settings (dispatcher, EP overlap, CUDA graphs,
recompute), never a value chosen to make the prediction agree; no constant of :mod:`moetrain.plan.constants` is
fitted to any of these points -- they are predicted with the same per-generation set as the four records.

The points are data, not code: ``moetrain/plan/data/validation.json`` (:data:`DATA_FILE`, shipped with the package)
holds, besides an ``about`` line,

* ``sources``: what each source tag of a point (the first word of :attr:`Point.source`: ``MB-26.02``,
  ``MLM-recipes``, ``ModelZoo``, ``TorchTitan``, ...) cites -- table, section, repository, commit;
* ``models``: the Hugging Face ``config.json`` fields of the models that are not moetrain presets, with their source;
* ``layouts``: named pipeline layouts (Megatron-Bridge's DeepSeek-V3 layouts), with their source;
* ``recipes``: the settings a recipe shares between its points (Megatron-Bridge 26.04, Megatron-LM's MoE recipes,
  TorchTitan, AutoModel, the ModelZoo's Mixtral), with their source;
* ``groups``: the points, by group, each with ``key``, ``source``, ``model``, ``gpu``, ``n_gpus``, an optional
  ``recipe``, ``plan`` (:class:`~moetrain.plan.plan.Plan` fields, over the recipe's), the published
  ``tflops_per_gpu`` or ``tokens_per_s_per_gpu``, ``note``, ``what_differs`` and optionally ``inconsistent``.

A plan's ``pp_layout`` is a layout string, ``{"named": <a layouts entry>}``, or ``{"even": [layers, PP, VP]}``
(:func:`even_layout`). :func:`load` reads the file and refuses a malformed one with :class:`ValidationDataError`.
TorchTitan and AutoModel publish tokens/s: those points are compared in tokens/s
(:attr:`Point.tokens_per_s_per_gpu`).

docs/validation.md holds the table with the latest predictions; ``moetrain plan --validate`` prints it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrain.plan.plan import Plan
from moetrain.plan.shape import ModelShape, load_shape, shape_from_hf, with_mtp_depth

if TYPE_CHECKING:
    from moetrain.plan.hardware import GPUSpec

#: The published validation points and their sources (package data).
DATA_FILE = Path(__file__).parent / "data" / "validation.json"

#: Goal of the issue: mean absolute error at most 12%, no point beyond 25%.
MAE_GOAL = 0.12
MAX_GOAL = 0.25


class ValidationDataError(ValueError):
    """The validation data file is malformed: the message names the file, the entry and what is wrong."""


def model_shape(name: str) -> ModelShape:
    """A validation model: a moetrain preset or one of :data:`MODEL_CONFIGS`."""
    if name in MODEL_CONFIGS:
        return shape_from_hf(MODEL_CONFIGS[name], name=name)
    return load_shape(name)


@dataclass(frozen=True)
class Point:
    """One published throughput outside the calibration records."""

    key: str
    source: str
    model: str
    gpu: str
    n_gpus: int
    plan: Plan
    tflops_per_gpu: float
    note: str = ""
    what_differs: tuple[str, ...] = field(default=())
    #: the source row's tokens/s and TFLOP/s disagree with the Megatron FLOPs of its model (kept in the set and in
    #: the MAE; the report also gives the MAE without such rows). No row of the set is flagged at present.
    inconsistent: bool = False
    #: the source's own figure when it publishes tokens/s (TorchTitan, NeMo AutoModel: their TFLOP/s use other
    #: FLOPs formulas); ``tflops_per_gpu`` is then that rate times the Megatron FLOPs per token of the plan
    #: (:func:`megatron_tflops`), so the comparison is one of tokens/s.
    tokens_per_s_per_gpu: float | None = None

    @property
    def release(self) -> str:
        """Software release the figure was measured with: the NeMo container of a Megatron-Bridge table ("26.06",
        "26.02", "25.11"), or the source ("ModelZoo", "TorchTitan", ...). The same configuration moves by tens of
        percent between releases (docs/validation.md), so the report also gives the MAE per release."""
        head = self.source.split()[0]
        return head[3:] if head.startswith("MB-") else head


def megatron_tflops(model: str, plan: Plan, tokens_per_s_per_gpu: float) -> float:
    """A published tokens/s per GPU in Megatron-Core TFLOP/s per GPU: times the Megatron FLOPs per token of
    ``model`` at the plan's sequence length and MTP depth (``moetrain.accounting``, what ``predict`` reports)."""
    return _megatron_tflops(model_shape(model), plan, tokens_per_s_per_gpu)


def _megatron_tflops(shape: ModelShape, plan: Plan, tokens_per_s_per_gpu: float) -> float:
    return tokens_per_s_per_gpu * with_mtp_depth(shape, plan.mtp_depth).flops_per_token(plan.seq_len) / 1e12


def even_layout(n_layers: int, pp: int, vpp: int = 1) -> str:
    """The pipeline layout Megatron-Core builds with ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split`` (the Qwen3 recipes of Megatron-Bridge and Megatron-LM): the embedding
    and the loss count as one layer each, and the ``n_layers + 2`` slots split evenly over the ``pp x vpp``
    chunks. E.g. 94 layers on PP4 x VP12: ``"Et|(t*2|)*46tL"``. Raises ValueError if the slots do not divide."""
    chunks = pp * vpp
    if (n_layers + 2) % chunks:
        raise ValueError(f"{n_layers} layers + embedding + loss do not split evenly over {chunks} chunks")
    per = (n_layers + 2) // chunks

    def run(n: int) -> str:
        return "t" if n == 1 else f"t*{n}"

    if chunks == 1:
        return f"E{run(n_layers)}L"
    middle = f"({run(per)}|)*{chunks - 2}" if chunks > 2 else ""
    return f"E{run(per - 1)}|{middle}{run(per - 1)}L"


def _check_keys(obj: Any, required: set[str], optional: set[str], where: str, path: Path) -> None:
    if not isinstance(obj, dict):
        raise _bad(path, f"{where} must be a JSON object, not {type(obj).__name__}")
    missing = required - obj.keys()
    unknown = obj.keys() - required - optional
    if missing:
        raise _bad(path, f"{where} lacks {sorted(missing)}")
    if unknown:
        raise _bad(path, f"{where} has unknown field(s) {sorted(unknown)}; allowed: {sorted(required | optional)}")


def _bad(path: Path, what: str) -> ValidationDataError:
    return ValidationDataError(f"validation data {path}: {what} (the format is in moetrain.plan.validation's "
                               "docstring)")


_PLAN_FIELDS = frozenset(f.name for f in dataclasses.fields(Plan))
_POINT_REQUIRED = {"key", "source", "model", "gpu", "n_gpus", "plan", "note", "what_differs"}
_POINT_OPTIONAL = {"recipe", "tflops_per_gpu", "tokens_per_s_per_gpu", "inconsistent"}


def _layout(value: Any, layouts: dict[str, str], where: str, path: Path) -> str:
    """A plan's ``pp_layout``: a layout string, ``{"named": name}`` or ``{"even": [layers, PP, VP]}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.keys() == {"named"}:
        if value["named"] not in layouts:
            raise _bad(path, f"{where}: pp_layout names {value['named']!r}, not one of the layouts {sorted(layouts)}")
        return layouts[value["named"]]
    if (isinstance(value, dict) and value.keys() == {"even"} and isinstance(value["even"], list)
            and len(value["even"]) == 3 and all(isinstance(x, int) for x in value["even"])):
        try:
            return even_layout(*value["even"])
        except ValueError as e:
            raise _bad(path, f"{where}: pp_layout {value}: {e}") from None
    raise _bad(path, f"{where}: pp_layout must be a layout string, {{\"named\": <layout>}} or "
                     f"{{\"even\": [layers, PP, VP]}}, not {value!r}")


def _plan(fields: Any, base: Plan | None, layouts: dict[str, str], where: str, path: Path) -> Plan:
    """``fields`` (Plan fields; JSON lists become tuples) as a Plan, over ``base`` when given."""
    if not isinstance(fields, dict):
        raise _bad(path, f"{where}: plan must be a JSON object of Plan fields")
    unknown = fields.keys() - _PLAN_FIELDS
    if unknown:
        raise _bad(path, f"{where}: unknown plan field(s) {sorted(unknown)}; Plan has {sorted(_PLAN_FIELDS)}")
    kw = {k: _layout(v, layouts, where, path) if k == "pp_layout" else tuple(v) if isinstance(v, list) else v
          for k, v in fields.items()}
    return base.replace(**kw) if base is not None else Plan(**kw)


def load(path: Path | str = DATA_FILE) -> tuple[dict[str, dict[str, Any]], tuple[Point, ...]]:
    """Read the validation data file (format in this module's docstring).

    Returns:
        (the models' Hugging Face config fields by name, the points in file order). A point that publishes tokens/s
        gets its TFLOP/s as that rate times the Megatron FLOPs per token of its plan (:func:`megatron_tflops`), so
        its error is the tokens/s error.

    Raises:
        ValidationDataError: the file cannot be read, is not JSON, or an entry is malformed -- a missing or unknown
            field, a source tag without a ``sources`` entry, an unknown recipe, layout, model or GPU, a duplicate
            key, or a published figure that is not a positive number; the message names the entry.
    """
    from moetrain.model.config import PRESETS
    from moetrain.plan.hardware import CATALOGUE

    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise _bad(path, f"cannot be read ({e}); it is package data: reinstall moetrain") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _bad(path, f"is not valid JSON ({e})") from None
    _check_keys(raw, {"sources", "models", "layouts", "recipes", "groups"}, {"about"}, "the top level", path)
    for name, entry in [*raw["models"].items(), *raw["layouts"].items(), *raw["recipes"].items()]:
        if not isinstance(entry, dict) or not isinstance(entry.get("source"), str) or not entry["source"]:
            raise _bad(path, f"{name!r} needs a non-empty \"source\"")
    configs: dict[str, dict[str, Any]] = {}
    for name, m in raw["models"].items():
        _check_keys(m, {"source", "config"}, set(), f"models.{name}", path)
        configs[name] = m["config"]
    layouts: dict[str, str] = {}
    for name, lay in raw["layouts"].items():
        _check_keys(lay, {"source", "layout"}, set(), f"layouts.{name}", path)
        layouts[name] = lay["layout"]
    recipes = {}
    for name, r in raw["recipes"].items():
        _check_keys(r, {"source", "plan"}, set(), f"recipes.{name}", path)
        recipes[name] = _plan(r["plan"], None, layouts, f"recipes.{name}", path)
    if not isinstance(raw["groups"], list):
        raise _bad(path, "\"groups\" must be a list of {\"title\", \"points\"}")
    points: list[Point] = []
    for g in raw["groups"]:
        _check_keys(g, {"title", "points"}, set(), "a group", path)
        for pt in g["points"]:
            where = f"point {pt.get('key', '?')!r}" if isinstance(pt, dict) else "a point"
            _check_keys(pt, _POINT_REQUIRED, _POINT_OPTIONAL, where, path)
            if not (isinstance(pt["key"], str) and isinstance(pt["source"], str) and isinstance(pt["note"], str)
                    and isinstance(pt["n_gpus"], int) and pt["n_gpus"] > 0
                    and isinstance(pt["what_differs"], list) and all(isinstance(w, str) for w in pt["what_differs"])
                    and isinstance(pt.get("inconsistent", False), bool)):
                raise _bad(path, f"{where}: key, source and note are strings, n_gpus a positive integer, "
                                 "what_differs a list of strings, inconsistent true or false")
            if pt["key"] in {p.key for p in points}:
                raise _bad(path, f"{where}: the key is used twice")
            tag = pt["source"].split()[0] if pt["source"].strip() else ""
            if tag not in raw["sources"]:
                raise _bad(path, f"{where}: source {pt['source']!r} starts with no tag of \"sources\" "
                                 f"{sorted(raw['sources'])}")
            if pt["model"] not in configs and pt["model"] not in PRESETS:
                raise _bad(path, f"{where}: model {pt['model']!r} is neither in \"models\" nor a moetrain preset")
            if pt["gpu"] not in CATALOGUE:
                raise _bad(path, f"{where}: gpu {pt['gpu']!r} is not in the catalogue {sorted(CATALOGUE)}")
            if "recipe" in pt and pt["recipe"] not in recipes:
                raise _bad(path, f"{where}: recipe {pt['recipe']!r} is not one of {sorted(recipes)}")
            figures = [k for k in ("tflops_per_gpu", "tokens_per_s_per_gpu") if k in pt]
            if len(figures) != 1 or isinstance(pt[figures[0]], bool) or not isinstance(pt[figures[0]], (int, float)) \
                    or pt[figures[0]] <= 0:
                raise _bad(path, f"{where}: give exactly one published figure, tflops_per_gpu or "
                                 "tokens_per_s_per_gpu, as a positive number")
            plan = _plan(pt["plan"], recipes.get(pt.get("recipe")), layouts, where, path)
            tokens = pt.get("tokens_per_s_per_gpu")
            if tokens is None:
                tflops = pt["tflops_per_gpu"]
            else:
                shape = (shape_from_hf(configs[pt["model"]], name=pt["model"]) if pt["model"] in configs
                         else load_shape(pt["model"]))
                tflops = _megatron_tflops(shape, plan, tokens)
            points.append(Point(pt["key"], pt["source"], pt["model"], pt["gpu"], pt["n_gpus"], plan, tflops,
                                pt["note"], tuple(pt["what_differs"]), inconsistent=pt.get("inconsistent", False),
                                tokens_per_s_per_gpu=tokens))
    return configs, tuple(points)


#: Hugging Face ``config.json`` fields of the validation models that are not moetrain presets, and the points.
MODEL_CONFIGS, POINTS = load()



@dataclass
class Row:
    """A validation point with its prediction (``predicted`` None when the plan does not fit or is invalid)."""

    point: Point
    predicted: float | None
    error: float | None
    message: str = ""
    prediction: Any = None


def run(points: tuple[Point, ...] = POINTS) -> list[Row]:
    """Predict every point with the catalogue's GPU and constants (no per-point setting beyond its published
    plan)."""
    from moetrain.plan.hardware import CATALOGUE
    from moetrain.plan.model import predict
    from moetrain.plan.plan import PlanError

    rows = []
    for pt in points:
        try:
            # the catalogue's entry, never a user's (--gpu-file, register_gpu) that shares its name
            pr = predict(model_shape(pt.model), CATALOGUE[pt.gpu], pt.n_gpus, pt.plan)
        except PlanError as e:
            rows.append(Row(pt, None, None, f"invalid plan: {e}"))
            continue
        if not pr.fits:
            rows.append(Row(pt, None, None, pr.message, pr))
            continue
        rows.append(Row(pt, pr.tflops_per_gpu, pr.tflops_per_gpu / pt.tflops_per_gpu - 1, pr.message, pr))
    return rows


def _group_stats(rows: list[Row]) -> dict[str, Any]:
    """``points`` (all rows), ``predicted``, ``mae`` and ``mean_signed_error`` (None without a prediction) of one
    group of rows."""
    errs = [r.error for r in rows if r.error is not None]
    return {"points": len(rows), "predicted": len(errs),
            "mae": sum(abs(e) for e in errs) / len(errs) if errs else None,
            "mean_signed_error": sum(errs) / len(errs) if errs else None}


def by_release(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Points, MAE, mean signed and largest error per software release (:attr:`Point.release`), newest first."""
    out: dict[str, dict[str, Any]] = {}
    rels = {r.point.release for r in rows}
    for rel in sorted((x for x in rels if x[:1].isdigit()), reverse=True) + sorted(x for x in rels if not x[:1].isdigit()):
        rs = [r for r in rows if r.point.release == rel]
        errs = [abs(r.error) for r in rs if r.error is not None]
        out[rel] = {**_group_stats(rs), "max_abs_error": max(errs) if errs else None}
    return out


def by_group(rows: list[Row]) -> dict[str, dict[str, dict[str, Any]]]:
    """Points, MAE and mean signed error grouped four ways -- by CUDA-graph coverage, by host CPU (x86 on HGX /
    DGX boards, Grace on NVL72), by GPU and by model -- the groupings that show where the error is
    (docs/validation.md, "Where the error is"). Rows without a prediction are left out of the errors, counted in
    ``points``."""
    from moetrain.plan.hardware import CATALOGUE

    keys = {"cuda_graphs": lambda pt: pt.plan.resolved_cuda_graphs,
            "host": lambda pt: CATALOGUE[pt.gpu].host_cpu or "x86",  # the catalogue's part, as in run()
            "gpu": lambda pt: pt.gpu,
            "model": lambda pt: pt.model}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, key in keys.items():
        groups: dict[str, list[Row]] = {}
        for r in rows:
            groups.setdefault(key(r.point), []).append(r)
        out[name] = {g: _group_stats(rs) for g, rs in sorted(groups.items())}
    return out


def repeats(rows: list[Row]) -> list[dict[str, Any]]:
    """Groups of points that publish one plan more than once (same model, GPU, GPU count, plan and source table;
    only the release differs), with the spread of their published figures.

    A model that sees only the plan gives every point of a group one prediction ``p``, so the group bounds the
    error any such model can reach there: the smallest largest error is ``(hi - lo) / (hi + lo)`` (``p`` the
    harmonic middle ``2 hi lo / (hi + lo)``); the smallest mean error is reached at one of the published figures
    (the mean of ``|p / x - 1|`` is convex and piecewise linear in ``p``), for a pair ``(1 - lo / hi) / 2``. E.g.
    1,199 and 1,298 TFLOP/s: 4.0% and 3.8%.

    Returns: one dict per group of two or more points, largest ``spread`` (hi / lo - 1) first, with ``keys``,
    ``published`` (TFLOP/s per GPU, in the order of ``keys``), ``spread``, ``min_max_error``, ``min_mean_error``.
    """
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        pt = r.point
        plan = pt.plan.to_dict()
        plan.pop("name", None)
        where = pt.source.split(None, 1)[1:] if pt.source.startswith("MB-") else [pt.source]
        key = (pt.model, pt.gpu, pt.n_gpus, tuple(where), tuple(sorted((k, repr(v)) for k, v in plan.items())))
        groups.setdefault(key, []).append(r)
    out = []
    for rs in groups.values():
        if len(rs) < 2:
            continue
        pub = [r.point.tflops_per_gpu for r in rs]
        lo, hi = min(pub), max(pub)
        out.append({"keys": [r.point.key for r in rs], "published": pub, "spread": hi / lo - 1,
                    "min_max_error": (hi - lo) / (hi + lo),
                    "min_mean_error": min(sum(abs(p / x - 1) for x in pub) / len(pub) for p in pub)})
    return sorted(out, key=lambda g: -g["spread"])


#: Fewest points of one GPU and CUDA-graph coverage for :func:`track_record` to speak of that group alone; with
#: fewer it speaks of all of the GPU's points and says so.
TRACK_RECORD_MIN_POINTS = 3

_GRAPHS_WORDS = {"full": "whole-iteration CUDA graphs", "partial": "partial CUDA graphs", "none": "no CUDA graphs"}


@functools.lru_cache(maxsize=None)
def _rows_where(gpu: str | None, model: str | None) -> tuple[Row, ...]:
    """The validation rows on one catalogue GPU or of one model, predicted once per process."""
    return tuple(run(tuple(p for p in POINTS if p.gpu == gpu or p.model == model)))


def _errors(rows: list[Row] | tuple[Row, ...]) -> dict[str, Any]:
    errs = sorted(r.error for r in rows if r.error is not None)
    m = len(errs)
    return {"points": m, "keys": [r.point.key for r in rows if r.error is not None],
            "mean_signed_error": sum(errs) / m, "median_error": (errs[(m - 1) // 2] + errs[m // 2]) / 2,
            "min_error": errs[0], "max_error": errs[-1]}


def track_record(gpu: GPUSpec, cuda_graphs: str, model: str | None = None) -> dict[str, Any]:
    """How the model did on the validation points (published runs no constant was set from) most like a plan: on
    its GPU with its CUDA-graph coverage -- all of that GPU's points when fewer than
    :data:`TRACK_RECORD_MIN_POINTS` share the coverage, flagged ``fallback`` -- and of its model on any GPU. A
    reader of one prediction sees the error of its kind of run (docs/validation.md); nothing here changes the
    prediction, a search or a constant.

    Args:
        gpu: the plan's GPU; its catalogue name selects the points. A ``--gpu-file`` entry or a what-if flag that
            changes a catalogue GPU gets that GPU's record with ``modified`` True (the points ran on the catalogue
            part); a GPU outside the catalogue gets no GPU record.
        cuda_graphs: the plan's resolved coverage, "full", "partial" or "none".
        model: the plan's model name (``Prediction.model``); points of the same name give the model record.

    Returns: ``{"gpu": G or None, "model": M or None}``. G has ``group`` (words), ``gpu``, ``cuda_graphs``,
    ``fallback``, ``modified`` and the error fields; M has ``model`` and the error fields. Error fields:
    ``points``, ``keys``, ``mean_signed_error``, ``median_error``, ``min_error``, ``max_error`` (fractions,
    predicted / published - 1: positive is over-predicted).
    """
    from moetrain.plan.hardware import CATALOGUE

    known_gpu = gpu.name if gpu.name in CATALOGUE and any(p.gpu == gpu.name for p in POINTS) else None
    known_model = model if model and any(p.model == model for p in POINTS) else None
    out: dict[str, Any] = {"gpu": None, "model": None}
    if known_gpu is None and known_model is None:
        return out
    rows = _rows_where(known_gpu, known_model)
    if known_gpu:
        on_gpu = [r for r in rows if r.point.gpu == known_gpu]
        same = [r for r in on_gpu if r.point.plan.resolved_cuda_graphs == cuda_graphs]
        fallback = len(same) < TRACK_RECORD_MIN_POINTS
        words = _GRAPHS_WORDS.get(cuda_graphs, cuda_graphs)
        group = (f"all {len(on_gpu)} {known_gpu.upper()} runs ({len(same)} with {words}, too few alone)" if fallback
                 else f"{len(same)} {known_gpu.upper()} runs with {words}")
        if any(r.error is not None for r in (on_gpu if fallback else same)):
            out["gpu"] = {"group": group, "gpu": known_gpu, "cuda_graphs": cuda_graphs, "fallback": fallback,
                          "modified": gpu != CATALOGUE[known_gpu], **_errors(on_gpu if fallback else same)}
    if known_model:
        of_model = [r for r in rows if r.point.model == known_model]
        if any(r.error is not None for r in of_model):
            out["model"] = {"model": known_model, **_errors(of_model)}
    return out


def repeats_bound(rows: list[Row], groups: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Over all points of :func:`repeats` (``groups``, computed from ``rows`` when not given): ``points``,
    ``best_mae`` (the MAE one prediction per plan could reach on them, each group's ``min_mean_error`` weighted by
    its points) and ``model_mae`` (the model's MAE on the same points); None when no plan is published twice."""
    groups = repeats(rows) if groups is None else groups
    if not groups:
        return None
    keys = {k for g in groups for k in g["keys"]}
    n = sum(len(g["keys"]) for g in groups)
    errs = [abs(r.error) for r in rows if r.point.key in keys and r.error is not None]
    return {"groups": len(groups), "points": n,
            "best_mae": sum(g["min_mean_error"] * len(g["keys"]) for g in groups) / n,
            "model_mae": sum(errs) / len(errs) if errs else None}


def summary(rows: list[Row]) -> dict[str, Any]:
    """Mean absolute error, largest error and the goal checks over the rows that have a prediction."""
    errs = [abs(r.error) for r in rows if r.error is not None]
    mae = sum(errs) / len(errs) if errs else None
    worst = max(errs) if errs else None
    clean = [abs(r.error) for r in rows if r.error is not None and not r.point.inconsistent]
    rep = repeats(rows)
    return {"points": len(rows), "predicted": len(errs), "mae": mae, "max_abs_error": worst,
            "mae_consistent_rows": sum(clean) / len(clean) if clean else None,
            "by_release": by_release(rows), "by_group": by_group(rows), "repeats": rep,
            "repeats_bound": repeats_bound(rows, rep),
            "mean_signed_error": (sum(r.error for r in rows if r.error is not None) / len(errs)) if errs else None,
            "mae_goal": MAE_GOAL, "max_goal": MAX_GOAL,
            "goal_met": bool(errs) and len(errs) == len(rows) and mae <= MAE_GOAL and worst <= MAX_GOAL}
