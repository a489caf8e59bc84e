"""GPU catalogue: peak rates, memory and links of the systems the performance model knows (docs/reference.md section 5).

Units, once and for all:

* ``peak_tflops``: dense (non-sparse) tensor-core TFLOP/s per GPU, by precision key ("bf16", "fp8", "mxfp8",
  "fp4", "fp32"). Vendor datasheets quote sparse figures for some precisions; these are halved.
* ``hbm_gb``: HBM capacity. Vendor "GB" capacities behave as GiB in practice (an H100 80 GB shows 81,559 MiB in
  nvidia-smi), so the memory model compares GiB against this number.
* ``hbm_tbps``: HBM bandwidth, TB/s (1e12 B/s).
* ``nvlink_gbps``: NVLink bandwidth per GPU **per direction**, GB/s (1e9 B/s) = half the bidirectional datasheet
  figure (H100: 900 GB/s bidirectional -> 450 GB/s each way). All-to-all and collectives are limited by the
  per-direction rate, since every GPU sends and receives at the same time.
* ``nvlink_domain``: GPUs that reach each other over NVLink (8 for an HGX board, 72 for an NVL72 rack).
* ``nic_gbps``: scale-out network bandwidth per GPU per direction, GB/s (a 400 Gb/s NIC = 50 GB/s).
* ``sfu_texp``: special-function-unit throughput for exponentials, 1e12 exp/s -- the softmax in attention is
  bounded by it on Blackwell; Blackwell Ultra (B300/GB300) doubles it (NVIDIA's "2x attention-layer acceleration").

User entries come from a TOML or JSON file (:func:`load_gpu_file`); a "local" entry is built from the
measurements of ``moetrain bench`` (:func:`gpu_from_bench`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

PRECISIONS = ("bf16", "fp8", "mxfp8", "fp4", "fp32")
GENERATIONS = ("hopper", "blackwell", "cpu")
#: Host CPU families of the catalogue's systems: x86 on HGX / DGX boards, Arm Grace on GB200 / GB300 NVL72.
#: Eager launches cost the host a different time on each (moetrain.plan.constants.HOST_S_PER_OP).
HOST_CPUS = ("x86", "grace")


class HardwareError(ValueError):
    """Unknown GPU name or malformed user GPU entry; the message lists what is allowed."""


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model and its links (see module docstring for units).

    Attributes:
        name: catalogue key (lower case).
        generation: "hopper", "blackwell" or "cpu"; selects the efficiency constants (moetrain.plan.constants).
        peak_tflops: dense TFLOP/s per precision.
        hbm_gb, hbm_tbps: memory capacity (GiB) and bandwidth (TB/s).
        nvlink_gbps: NVLink GB/s per direction per GPU. nvlink_domain: GPUs per NVLink domain.
        nic_gbps: scale-out GB/s per direction per GPU.
        sfu_texp: exponentials per second (1e12) for the attention softmax.
        a2a_latency_us: measured per-call all-to-all latency (local bench entries only; None = generation default).
        op_overhead_us: measured per-operator launch/dispatch overhead (local bench entries only).
        fsdp_unit_latency_us, fsdp_unit_gbps: measured cost one FSDP2 unit adds to a forward + backward
            (all-gathers, reduce-scatter, hooks, copies): ``latency + unit parameter bytes / rate`` (local bench
            entries only; None = modelled from the link bandwidth).
        softmax_gelem_s: measured log-softmax cross-entropy forward + backward rate, 1e9 logits per second (local
            bench entries only; None = the loss is memory-bound, as on GPUs).
        matmul_curve: measured (matrix size n, TFLOP/s) points of an n x n x n matmul (local bench entries only).
        host_procs: processes the bench ran at once on one machine (local bench entries only): its rates hold for
            a run of that many processes, each with ``hbm_gb`` (the machine's memory divided among them).
        sm_count: streaming multiprocessors (the communication kernels' SMs are a share of these; None = the
            generation's ``comm_sm_share``).
        power_w: the SKU's power limit (documentation: it is why HGX and NVL72 parts of one die have different
            dense peaks in the datasheets, which are the rates used).
        tensor_sustain: what this SKU sustains of the tensor-core rate its generation's efficiency gives on its
            datasheet peak (1.0 = the generation's figure). Below 1 only where a public measurement of that SKU
            shows its power cap holding large GEMMs lower than the datasheet peak ratio says (see CATALOGUE).
        host_cpu: the host CPU family driving the GPU ("x86" or "grace"; None = x86): eager kernel launches cost
            its host time (moetrain.plan.constants.HOST_S_PER_OP).
        source: where the numbers come from.
    """

    name: str
    generation: str
    peak_tflops: dict[str, float]
    hbm_gb: float
    hbm_tbps: float
    nvlink_gbps: float
    nvlink_domain: int
    nic_gbps: float
    sfu_texp: float = 4.0
    a2a_latency_us: float | None = None
    op_overhead_us: float | None = None
    fsdp_unit_latency_us: float | None = None
    fsdp_unit_gbps: float | None = None
    softmax_gelem_s: float | None = None
    matmul_curve: tuple[tuple[int, float], ...] = field(default=())
    host_procs: int | None = None
    sm_count: int | None = None
    power_w: float | None = None
    tensor_sustain: float = 1.0
    host_cpu: str | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.generation not in GENERATIONS:
            raise HardwareError(f"GPU {self.name!r}: generation={self.generation!r}; allowed: {list(GENERATIONS)}")
        numeric = ("hbm_gb", "hbm_tbps", "nvlink_gbps", "nic_gbps", "sfu_texp", "tensor_sustain", "a2a_latency_us",
                   "op_overhead_us", "fsdp_unit_latency_us", "fsdp_unit_gbps", "softmax_gelem_s", "power_w")
        for f in numeric:
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise HardwareError(f"GPU {self.name!r}: {f}={v!r} must be a number")
        bad = sorted(set(self.peak_tflops) - set(PRECISIONS))
        if bad:
            raise HardwareError(f"GPU {self.name!r}: unknown precision key(s) {bad} in peak_tflops; allowed: "
                                f"{list(PRECISIONS)}")
        for k, v in self.peak_tflops.items():
            if not v > 0:
                raise HardwareError(f"GPU {self.name!r}: peak_tflops[{k!r}]={v} must be > 0")
        for f in ("hbm_gb", "hbm_tbps", "nvlink_gbps", "nic_gbps", "sfu_texp"):
            if not getattr(self, f) > 0:
                raise HardwareError(f"GPU {self.name!r}: {f}={getattr(self, f)} must be > 0")
        for f in ("a2a_latency_us", "op_overhead_us", "fsdp_unit_latency_us", "softmax_gelem_s"):
            v = getattr(self, f)
            if v is not None and v < 0:
                raise HardwareError(f"GPU {self.name!r}: {f}={v} must be >= 0")
        if self.fsdp_unit_gbps is not None and not self.fsdp_unit_gbps > 0:
            raise HardwareError(f"GPU {self.name!r}: fsdp_unit_gbps={self.fsdp_unit_gbps} must be > 0")
        if self.host_procs is not None and (not isinstance(self.host_procs, int) or self.host_procs < 1):
            raise HardwareError(f"GPU {self.name!r}: host_procs={self.host_procs!r} must be an integer >= 1")
        if not 0 < self.tensor_sustain <= 1.0:
            raise HardwareError(f"GPU {self.name!r}: tensor_sustain={self.tensor_sustain} must be in (0, 1]")
        if self.host_cpu is not None and self.host_cpu not in HOST_CPUS:
            raise HardwareError(f"GPU {self.name!r}: host_cpu={self.host_cpu!r}; allowed: {list(HOST_CPUS)}")
        if not isinstance(self.nvlink_domain, int) or self.nvlink_domain < 1:
            raise HardwareError(f"GPU {self.name!r}: nvlink_domain={self.nvlink_domain!r} must be an integer >= 1")

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s (not TFLOP/s) for a precision; mxfp8 falls back to fp8 only on Blackwell.

        Raises:
            HardwareError: the GPU has no tensor-core rate for that precision.
        """
        if precision in self.peak_tflops:
            return self.peak_tflops[precision] * 1e12
        raise HardwareError(f"GPU {self.name!r} has no {precision} rate (has {sorted(self.peak_tflops)})"
                            + ("; MXFP8 needs Blackwell (use fp8 on Hopper)" if precision == "mxfp8" else ""))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["matmul_curve"] = [list(p) for p in self.matmul_curve]
        return d


def _gpu(name: str, gen: str, bf16: float, fp8: float, fp4: float | None, fp32: float, hbm: float, hbm_bw: float,
         nvl_bidir: float, domain: int, nic_gbit: float, sfu: float, source: str, sm: int | None = None,
         power: float | None = None, sustain: float = 1.0, host: str = "x86") -> GPUSpec:
    peaks = {"bf16": bf16, "fp8": fp8, "fp32": fp32}
    if gen == "blackwell":
        peaks["mxfp8"] = fp8
    if fp4:
        peaks["fp4"] = fp4
    return GPUSpec(name=name, generation=gen, peak_tflops=peaks, hbm_gb=hbm, hbm_tbps=hbm_bw,
                   nvlink_gbps=nvl_bidir / 2, nvlink_domain=domain, nic_gbps=nic_gbit / 8, sfu_texp=sfu,
                   sm_count=sm, power_w=power, tensor_sustain=sustain, host_cpu=host, source=source)


_DS = "vendor datasheet (docs/reference.md section 5; dense peaks, NVLink halved to per-direction)"
#: The built-in catalogue. FP32 is the non-tensor-core rate (the FP32 router GEMM runs there): 67 TFLOP/s on
#: H100/H800/H200 SXM, 75 on HGX B200/B300, 80 per GPU of GB200/GB300 NVL72 (5,760 TFLOP/s per rack). SFU rates: Hopper 132 SMs x 16 exp/clk x ~1.83 GHz ~ 3.9e12/s; Blackwell ~5e12/s;
#: Blackwell Ultra 10.7e12/s (NVIDIA Blackwell Ultra technical brief).
#: Sustained rates: the datasheet dense peaks already differ by SKU where the power limit sets the clock (HGX B200
#: at 1,000 W: 2.25 PF BF16; GB200 at 1,200 W: 2.5 PF; HGX B300 at 1,100 W: 2.25 PF; GB300 at 1,400 W: 2.5 PF),
#: and what a GEMM or kernel reaches of them is the generation's efficiency (constants.py). SM counts: 132 on
#: H100/H800/H200 SXM (H100 whitepaper), 160 on Blackwell Ultra B300 / GB300 (NVIDIA "Inside NVIDIA Blackwell
#: Ultra"), 148 on B200 / GB200 (the device query's figure; no NVIDIA document found: an assumption);
#: docs/reference.md section 12.
#: Sustained tensor rate per SKU (``tensor_sustain``): what a GEMM sustains on this SKU relative to the part the
#: generation's efficiencies (constants.py) describe -- GB300 on Blackwell (the calibration record ran there),
#: H100 / H800 on Hopper. Microsoft's Azure AI benchmarking guide measures SKUs with one harness (cuBLASLt FP8,
#: random inputs, 10,000 warm-up iterations, so at the clock the part holds under its power limit):
#: Azure/AI-benchmarking-guide 2a370be, Azure_Results/ND_GB200_v6_results.md (CUDA 12.8), gives 16,384^3 at
#: 2,906.9 TFLOP/s on GB200, and egmsft/AI-benchmarking-guide 18e80a2, ND_GB300_v6_results.md (CUDA 13.0), 3,308.5
#: on GB300, both on 5 PF datasheets: GB200 sustains 0.879 of GB300 (0.86-0.88 at 4,096^3-32,768^3; that fork's
#: own GB200 re-run, 2,819.5, would give 0.852; part of the gap may be the CUDA version). H100 and H200 in the
#: same file set, both on CUDA 12.6: 1,377.3 and 1,366.3 -- the same within 1%, so H200 keeps 1.0. An HGX B200
#: has no row there; TransformerEngine issue #1747 measures an FP8 te.Linear (quantisation included) at 8,192^3
#: at 2,377 TFLOP/s on one, 0.755 of 0.70 x 4.5 PF (FBGEMM PR #4197 shows the same power-cap gap). HGX B300 has no
#: measurement under load. Where parts share a datasheet peak, what they sustain follows their power limits: GB200
#: measures 0.879 of GB300 where 1,200 / 1,400 W gives 0.857; H200 measures H100's rate at the same 700 W. A short
#: run, before the power limit binds, cannot tell HGX B300 from HGX B200: the Maximum Achievable Matmul FLOPS table
#: (stas00/ml-engineering b9e2972, compute/accelerator/README.md; 100 iterations of the best shape) gives B300 SXM
#: 1,769.0 BF16 / 3,353.3 FP8 TFLOP/s, B200 SXM 1,745.0 / 3,432.5. So HGX B300 takes its HGX sibling's measured
#: 0.755 times their power limits, 1,100 / 1,000 W: 0.83. H800 is H100's die at the same 700 W: 1.0.
#: Host CPUs (``host_cpu``): HGX / DGX boards have x86 hosts, GB200 / GB300 NVL72 trays Arm Grace CPUs, on which
#: the same eager PyTorch call takes 2.75x the host time (TransformerEngine issue #2053; constants.HOST_S_PER_OP).
CATALOGUE: dict[str, GPUSpec] = {g.name: g for g in (
    _gpu("h100", "hopper", 989, 1979, None, 67, 80, 3.35, 900, 8, 400, 3.9, _DS + "; H100 SXM", sm=132, power=700),
    _gpu("h800", "hopper", 989, 1979, None, 67, 80, 3.35, 400, 8, 400, 3.9,
         _DS + "; H800 SXM: NVLink 400 GB/s bidirectional (~160 GB/s per direction measured by DeepEP)", sm=132,
         power=700),
    _gpu("h200", "hopper", 989, 1979, None, 67, 141, 4.8, 900, 8, 400, 3.9, _DS + "; H200 SXM", sm=132, power=700),
    _gpu("b200", "blackwell", 2250, 4500, 9000, 75, 180, 8.0, 1800, 8, 400, 5.0,
         _DS + "; HGX B200; sustained tensor rate 0.755 of the generation's: TransformerEngine issue #1747 (FP8 "
         "te.Linear 8,192^3 at 2,377 TFLOP/s on an HGX B200), FBGEMM PR #4197 (B200 at its power cap 0.71 of GB200 "
         "on FP8 GEMMs)", sm=148, power=1000, sustain=0.755),
    _gpu("b300", "blackwell", 2250, 4500, 13500, 75, 288, 8.0, 1800, 8, 800, 10.7,
         "vendor datasheet (HGX B300; docs/reference.md section 12): dense BF16 2.25 PF, FP8 4.5 PF, FP4 13.5 PF, "
         "288 GB HBM3e 8 TB/s, NVLink 5 1.8 TB/s, ConnectX-8 800 Gb/s; sustained tensor rate 0.83: HGX B200's "
         "measured 0.755 times the power limits 1,100 / 1,000 W (same datasheet peaks; short MAMF runs measure the two "
         "SKUs' GEMMs alike, the power limit is what differs under load)", sm=160, power=1100,
         sustain=round(0.755 * 1100 / 1000, 3)),
    _gpu("gb200", "blackwell", 2500, 5000, 10000, 80, 186, 8.0, 1800, 72, 400, 5.0,
         _DS + "; GB200 NVL72; sustained tensor rate 0.879 of GB300's (Azure AI benchmarking guide, cuBLASLt FP8 "
         "16,384^3 after 10,000 warm-up iterations: 2,906.9 against 3,308.5 TFLOP/s)", sm=148, power=1200,
         sustain=0.879, host="grace"),
    _gpu("gb300", "blackwell", 2500, 5000, 15000, 80, 288, 8.0, 1800, 72, 800, 10.7, _DS + "; GB300 NVL72", sm=160,
         power=1400, host="grace"),
)}

_ALIASES = {"h100-sxm": "h100", "h800-sxm": "h800", "h200-sxm": "h200", "gb200-nvl72": "gb200",
            "gb300-nvl72": "gb300", "gb200nvl72": "gb200", "gb300nvl72": "gb300"}

#: User-registered entries (``register_gpu`` / ``load_gpu_file``), looked up before the catalogue: an entry named
#: like a catalogue GPU replaces it (a what-if on a known part).
_USER: dict[str, GPUSpec] = {}


def catalogue_names() -> list[str]:
    return sorted(set(CATALOGUE) | set(_USER))


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by name (case-insensitive; "GB300", "gb300-nvl72" and "gb300" are the same).

    Raises:
        HardwareError: unknown name; the message lists the catalogue.
    """
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key in _USER:
        return _USER[key]
    if key in CATALOGUE:
        return CATALOGUE[key]
    raise HardwareError(f"unknown GPU {name!r}; the catalogue has {catalogue_names()} "
                        "(add your own with --gpu-file FILE.toml, or run `moetrain bench` and use --gpu local)")


def gpu_for_device_name(device_name: str) -> GPUSpec | None:
    """The catalogue entry of a CUDA device name as the driver reports it ("NVIDIA H100 80GB HBM3" -> h100,
    "NVIDIA GB200" -> gb200); None when the catalogue has no such GPU. Longest names first, so GB200 is not read as
    B200."""
    compact = device_name.replace(" ", "").lower()
    for key in sorted(CATALOGUE, key=len, reverse=True):
        if key in compact:
            return CATALOGUE[key]
    return None


def register_gpu(spec: GPUSpec) -> GPUSpec:
    """Add (or replace) a user GPU entry, available to :func:`get_gpu` under ``spec.name``."""
    _USER[spec.name.lower()] = spec
    return spec


def gpu_from_dict(d: dict[str, Any], name: str | None = None) -> GPUSpec:
    """Build a GPUSpec from a user entry. Link rates may be given as datasheet numbers:
    ``nvlink_gbps_bidir`` (halved), ``nic_gbit`` (Gb/s, divided by 8); else ``nvlink_gbps`` / ``nic_gbps``.

    Example TOML::

        [gpu.mi355x]
        generation = "blackwell"          # which efficiency constants apply
        peak_tflops = {bf16 = 2300, fp8 = 4600}
        hbm_gb = 288
        hbm_tbps = 8.0
        nvlink_gbps_bidir = 1075
        nvlink_domain = 8
        nic_gbit = 400

    Raises:
        HardwareError: a required key is missing or a value is invalid.
    """
    if not isinstance(d, dict):
        raise HardwareError(f"GPU entry {name or '(unnamed)'!r}: expected a table of keys (generation, peak_tflops, "
                            f"hbm_gb, ...), got {type(d).__name__} {d!r}")
    d = dict(d)
    nm = (name or d.pop("name", None))
    d.pop("name", None)
    if not nm:
        raise HardwareError("a user GPU entry needs a name")

    def num(key: str) -> float:
        try:
            return float(d.pop(key))
        except (TypeError, ValueError):
            raise HardwareError(f"GPU entry {nm!r}: {key} must be a number") from None

    if "nvlink_gbps_bidir" in d:
        d["nvlink_gbps"] = num("nvlink_gbps_bidir") / 2
    if "nic_gbit" in d:
        d["nic_gbps"] = num("nic_gbit") / 8
    required = ("generation", "peak_tflops", "hbm_gb", "hbm_tbps", "nvlink_gbps", "nvlink_domain", "nic_gbps")
    missing = [k for k in required if k not in d]
    if missing:
        raise HardwareError(f"GPU entry {nm!r} lacks {missing}; required: {list(required)} (link rates may also be "
                            "given as nvlink_gbps_bidir and nic_gbit)")
    known = {f for f in GPUSpec.__dataclass_fields__} - {"name"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise HardwareError(f"GPU entry {nm!r}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    if not isinstance(d["peak_tflops"], dict):
        raise HardwareError(f"GPU entry {nm!r}: peak_tflops must be a table like {{bf16 = 989, fp8 = 1979}}")
    try:
        d["peak_tflops"] = {str(k).lower(): float(v) for k, v in d["peak_tflops"].items()}
    except (TypeError, ValueError):
        raise HardwareError(f"GPU entry {nm!r}: peak_tflops values must be numbers (TFLOP/s), got "
                            f"{d['peak_tflops']!r}") from None
    if d["generation"] == "blackwell" and "fp8" in d["peak_tflops"]:
        d["peak_tflops"].setdefault("mxfp8", d["peak_tflops"]["fp8"])
    if "matmul_curve" in d:
        d["matmul_curve"] = tuple((int(n), float(t)) for n, t in d["matmul_curve"])
    try:
        d["nvlink_domain"] = int(d["nvlink_domain"])
        return GPUSpec(name=str(nm).lower(), **d)
    except HardwareError:
        raise  # already names the GPU
    except (TypeError, ValueError) as e:
        raise HardwareError(f"GPU entry {nm!r}: a value has the wrong type ({e}); numbers are plain numbers, "
                            f"generation a string") from None


def load_gpu_file(path: str | os.PathLike) -> list[GPUSpec]:
    """Read user GPU entries from TOML (``[gpu.NAME]`` tables) or JSON (``{"gpu": {"NAME": {...}}}`` or a list of
    entries with ``name``) and register them.

    Raises:
        HardwareError: unreadable file or bad entry.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise HardwareError(f"cannot read GPU file {p}: {e}") from None
    try:
        if p.suffix.lower() == ".toml":
            try:
                import tomllib
            except ImportError:  # pragma: no cover - python < 3.11
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - report any parse error with the file name
        raise HardwareError(f"cannot parse GPU file {p}: {e}") from None
    entries = data.get("gpu", data) if isinstance(data, dict) else data
    out: list[GPUSpec] = []
    if isinstance(entries, dict):
        for nm, e in entries.items():
            out.append(register_gpu(gpu_from_dict(e, name=nm)))
    elif isinstance(entries, list):
        for e in entries:
            out.append(register_gpu(gpu_from_dict(e)))
    else:
        raise HardwareError(f"GPU file {p}: expected [gpu.NAME] tables or a list of entries")
    return out


# ---- the local machine, from `moetrain bench` ------------------------------------------------------------------

DEFAULT_BENCH_PATH = Path(".cache") / "moetrain" / "bench.json"
#: Layout of the ``moetrain bench`` results file: ``moetrain.plan.bench`` writes it, :func:`gpu_from_bench` refuses
#: older files (2: collectives timed in lock-step with compute, FSDP2 unit and cross-entropy rate measured).
BENCH_VERSION = 2


def gpu_from_bench(bench: dict[str, Any] | str | os.PathLike | None = None, name: str = "local") -> GPUSpec:
    """A "cpu" GPUSpec built from ``moetrain bench`` measurements (a dict or the JSON file it wrote).

    The measured large-matmul rate becomes ``peak_tflops['fp32']`` (and bf16 when measured), measured memory copy
    bandwidth becomes ``hbm_tbps``, the measured all-to-all bandwidth between local processes becomes both
    ``nvlink_gbps`` and ``nic_gbps`` (one machine = one domain), and the measured latencies are kept. Each of the
    bench's ``procs`` processes (``host_procs``) gets an equal share of the machine's memory as its ``hbm_gb``.

    Raises:
        HardwareError: no bench file (run ``moetrain bench`` first) or a malformed one.
    """
    if bench is None:
        bench = DEFAULT_BENCH_PATH
    if not isinstance(bench, dict):
        p = Path(bench)
        if not p.is_file():
            raise HardwareError(f"no bench results at {p}; run `moetrain bench` first (it writes that file)")
        try:
            bench = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise HardwareError(f"cannot read bench results {p}: {e}") from None
    version = bench.get("bench_version", 1)
    if version < BENCH_VERSION:
        raise HardwareError(f"bench results of an older layout (version {version}; collectives were timed in an idle "
                            f"loop and FSDP2 was not measured); rerun `moetrain bench`")
    try:
        mm = bench["matmul"]
        curve = tuple(sorted((int(r["n"]), float(r["tflops"])) for r in mm["fp32"]))
        peaks = {"fp32": max(t for _, t in curve)}
        if mm.get("bf16"):
            peaks["bf16"] = max(float(r["tflops"]) for r in mm["bf16"])
        a2a = bench["all_to_all"]
        a2a_bw = float(a2a["bandwidth_gbps"])
        fsdp = bench["fsdp_unit"]
        procs = int(bench.get("procs", 2))
        spec = GPUSpec(
            name=name, generation="cpu", peak_tflops=peaks, host_procs=procs,
            hbm_gb=float(bench.get("memory_gb", 16.0)) / procs, hbm_tbps=float(bench["memory_bandwidth_gbps"]) / 1e3,
            nvlink_gbps=a2a_bw, nvlink_domain=1 << 20, nic_gbps=a2a_bw, sfu_texp=1e3,
            a2a_latency_us=float(a2a["latency_us"]), op_overhead_us=float(bench["op_overhead_us"]),
            fsdp_unit_latency_us=float(fsdp["latency_us"]), fsdp_unit_gbps=float(fsdp["bandwidth_gbps"]),
            softmax_gelem_s=float(bench["cross_entropy_gelem_s"]),
            matmul_curve=curve, source=f"moetrain bench on {bench.get('host', 'this machine')}",
        )
    except (KeyError, TypeError, ValueError) as e:
        raise HardwareError(f"malformed bench results ({e!r}); rerun `moetrain bench`") from None
    return register_gpu(spec)


def with_overrides(spec: GPUSpec, **changes: Any) -> GPUSpec:
    """A copy of ``spec`` with some fields changed (e.g. ``nic_gbps=100``), for what-if studies."""
    return replace(spec, **changes)
