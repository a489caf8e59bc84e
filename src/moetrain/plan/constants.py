"""Every efficiency constant of the performance model, in one place, with the reason for its value.

Rules (from the issue): constants are few, named, documented, and shared by every system of a GPU generation.
Nothing here is fitted to one published data point: a value is either a published microbenchmark of that
generation or a property of the software stack that applies to every run of it. ``docs/performance-model.md``
repeats the table and shows what each constant does to the predictions of docs/reference.md section 4.

A constant is a *fraction of a hardware peak* (``GPUSpec``) unless its name says otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak for one GPU generation.

    Attributes:
        gemm_bf16: large dense BF16 GEMM (projections, dense FFN, shared expert, output head), fraction of BF16 peak.
        gemm_fp8: large dense FP8 / MXFP8 GEMM including the scaling overhead, fraction of the FP8 peak.
        grouped_gemm: routed-expert grouped GEMM relative to a dense GEMM of the same precision (ragged per-expert
            row counts, tile quantisation, one launch for many small problems).
        attention: fused (flash) attention forward + backward, fraction of the peak of its precision.
        sfu: achieved fraction of the exponential (SFU) rate inside the attention softmax.
        hbm: achieved fraction of HBM bandwidth in memory-bound kernels (norms, activations, permutes, casts,
            optimizer).
        nvlink: achieved fraction of the per-direction NVLink bandwidth in all-to-all and collectives.
        nic: achieved fraction of the per-direction NIC bandwidth (RDMA) in all-to-all and collectives.
        a2a_latency_s: fixed cost of one dispatch or one combine call (kernel launch, handshakes, metadata).
        comm_sm_share: share of the SMs the all-to-all kernels occupy while they run; when communication is
            overlapped with compute, the compute runs on the remaining SMs.
        gemm_k0: the fixed cost of one output tile of a tensor-core GEMM (prologue, pipeline fill, epilogue),
            expressed as the contraction length K whose main loop takes as long, for BF16. A GEMM pass of
            contraction K runs at ``K / (K + K0)`` of its large-K rate; the GEMM efficiencies above are quoted
            at ``GEMM_REF_K``. The fixed cost is a time, so an FP8 main loop, which consumes K faster by the
            generation's FP8 / BF16 rate ratio (2 gemm_fp8 / gemm_bf16: both datasheets double the peak), has
            its K0 larger by that ratio (:meth:`tile_k0`); an FP8 pass is then never slower than a BF16 one.
        wgrad_fp8: rate of an FP8 weight-gradient GEMM (contraction over tokens, FP32 accumulation into the
            gradient) relative to a forward GEMM of the same contraction length.
        a2a_row_s: the fixed time of one row (one token to one destination) in the flex dispatch and combine
            kernels (DeepEP, HybridEP) on NVLink, on top of the time of its bytes. ``nvlink`` is quoted at rows of
            ``A2A_REF_ROW_BYTES`` (the rows of its measurements), so rows of other sizes scale by
            :meth:`row_factor`: smaller rows (a smaller hidden size, FP8) take longer per byte.
    """

    generation: str
    gemm_bf16: float
    gemm_fp8: float
    grouped_gemm: float
    attention: float
    sfu: float
    hbm: float
    nvlink: float
    nic: float
    a2a_latency_s: float
    comm_sm_share: float
    gemm_k0: float = 0.0
    wgrad_fp8: float = 1.0
    a2a_row_s: float = 0.0

    def gemm(self, precision: str) -> float:
        return self.gemm_bf16 if precision in ("bf16", "fp32") else self.gemm_fp8

    def tile_k0(self, fp8: bool) -> float:
        """K0 of :attr:`gemm_k0` for a BF16 (``fp8`` False) or FP8 tensor-core GEMM: the same time per tile,
        times the FP8 main loop's speed-up ``2 gemm_fp8 / gemm_bf16``."""
        return self.gemm_k0 * (2.0 * self.gemm_fp8 / self.gemm_bf16 if fp8 else 1.0)

    def shape_factor(self, k: float, fp8: bool) -> float:
        """Rate of a tensor-core GEMM pass with contraction length ``k`` relative to the same GEMM at
        ``GEMM_REF_K``: ``(k / (k + K0)) / (K_ref / (K_ref + K0))`` (1 when ``gemm_k0`` is 0)."""
        k0 = self.tile_k0(fp8)
        if k0 <= 0 or k <= 0:
            return 1.0
        return (k / (k + k0)) / (GEMM_REF_K / (GEMM_REF_K + k0))

    def row_factor(self, row_bytes: float, rate: float) -> float:
        """Time of an NVLink dispatch / combine pass of ``row_bytes``-byte rows relative to the same bytes moved at
        ``rate`` (bytes/s: the link's rate times ``nvlink``, which holds for rows of ``A2A_REF_ROW_BYTES``):
        ``1 + rate * a2a_row_s * (1 / row_bytes - 1 / A2A_REF_ROW_BYTES)``. That is the pass time
        ``rows * (row_bytes / B + a2a_row_s)`` with the byte rate ``B`` set so that reference rows move at ``rate``
        (1 when ``a2a_row_s`` is 0).

        Raises:
            ValueError: ``row_bytes`` or ``rate`` is not positive.
        """
        if row_bytes <= 0 or rate <= 0:
            raise ValueError(f"row_bytes and rate must be > 0, got {row_bytes}, {rate}")
        return 1.0 + rate * self.a2a_row_s * (1.0 / row_bytes - 1.0 / A2A_REF_ROW_BYTES)

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


#: Contraction length at which the generations' GEMM efficiencies are quoted: the 8,192^3 GEMMs of the
#: measurements they come from (docs/performance-model.md, "The constants"). Other contraction lengths scale by
#: :meth:`Efficiency.shape_factor`.
GEMM_REF_K = 8192.0

#: Row size (bytes) at which the generations' ``nvlink`` efficiencies are quoted: a BF16 row of DeepSeek-V3's
#: hidden size 7,168, the hidden size of the dispatch / combine measurements they come from (DeepEP's H800 table,
#: whose dispatch rows are FP8 and combine rows BF16; the Megatron-LM GB200 guide's HybridEP figure). Other row
#: sizes scale by :meth:`Efficiency.row_factor`.
A2A_REF_ROW_BYTES = 7168 * 2.0

#: Hopper: H100, H800, H200.
HOPPER = Efficiency(
    generation="hopper",
    # Measured here on an H200: an 8192^3 BF16 matmul runs at ~790 of 989 TFLOP/s (0.80, docs/reference.md section 5);
    # the K = 7168 / N = 1.5K-18K shapes of a training layer and Transformer Engine's wrappers land a little lower.
    gemm_bf16=0.75,
    # FP8 GEMMs with 1x128 / 128x128 block scales: DeepGEMM reports 1,300-1,550 TFLOP/s for large dense shapes on
    # H800 (0.66-0.78 of 1,979), but Hopper promotes the partial sums to FP32 on CUDA cores every 128 elements
    # (DeepSeek-V3 report sec. 3.3.2) and the quantisation kernels sit next to every GEMM; 0.60 is the usual
    # training-shape figure.
    gemm_fp8=0.60,
    # Grouped GEMM vs dense: DeepGEMM's grouped "contiguous" kernels reach ~1,230-1,300 of the ~1,400 TFLOP/s of
    # its dense kernels at training sizes (~0.9).
    grouped_gemm=0.90,
    # FlashAttention-3 on H100: forward 600-750 TFLOP/s BF16 (0.6-0.75) for head dim 128, backward 450-550
    # (0.45-0.55); backward is 2/3 of the FLOPs. MLA's 192/128 q/v head dims are off the tuned sizes -> 0.45.
    attention=0.45,
    # Softmax exponentials overlap with the MMAs in FA3; 0.8 of the MUFU rate is reachable.
    sfu=0.80,
    # A device copy reaches ~4.3 of 4.8 TB/s on an H200 (0.9, docs/reference.md section 5); norms, RoPE, permutes and
    # casts have strided or gathered accesses -> 0.70.
    hbm=0.70,
    # DeepEP intranode dispatch/combine: 153-158 GB/s of the 200 GB/s per-direction NVLink of an H800 (0.77-0.79).
    nvlink=0.78,
    # DeepEP internode: 43-58 GB/s "RDMA bandwidth" per 400 Gb/s (50 GB/s) NIC; a sustained 0.85 is typical RDMA
    # goodput (docs/reference.md section 5).
    nic=0.85,
    # DeepEP "normal" kernels: tens of microseconds per call even for small batches.
    a2a_latency_s=30e-6,
    # DeepSeek-V3 dedicates 20 of 132 SMs to communication (0.15); Megatron's HybridEP default is 32 SMs (0.24).
    comm_sm_share=0.20,
    # DeepGEMM's H800 FP8 table (README at 327ec92, M = 4096): K = 512 / 1,536 / 2,048 / 7,168 / 16,384 run at
    # 775 / 1,212 / 1,168 / 1,410 / 1,520 TFLOP/s; R K / (K + K0) fits them with K0 = 500 (least squares in log,
    # rms 3.4%; the N = 2,112 row, a wave-quantised grid of 3.4 waves on 132 SMs, left out). That is FP8; the
    # BF16 K0 is 500 / (2 x 0.60 / 0.75) = 312 (the fixed cost is a time per tile, see tile_k0).
    gemm_k0=312.5,
    # DeepGEMM PR #95 (H800): FP8 weight-gradient GEMMs at 4,096 tokens run at 878-994 TFLOP/s for the weights
    # whose forward GEMMs the README table gives; against the forward rate at the same contraction length (the
    # shape factor above) that is 0.64-0.86, median 0.70.
    wgrad_fp8=0.70,
    # DeepEP V1's H800 intranode table (hidden 7,168, 4,096 tokens): FP8 dispatch rows of 7,392 bytes (7,168 + 56
    # FP32 scales) at 153 GB/s, BF16 combine rows of 14,336 bytes at 158 GB/s: 48.3 and 90.7 ns a row, i.e. a byte
    # rate of 163.7 GB/s (the ~160 GB/s link) plus 3.16 ns a row. (Dispatch and combine are different kernels; no
    # Hopper table moves one kernel's NVLink rows at two sizes.)
    a2a_row_s=3.16e-9,
)

#: Blackwell: B200, B300, GB200 NVL72, GB300 NVL72.
BLACKWELL = Efficiency(
    generation="blackwell",
    # cuBLAS BF16 on B200: ~1.6-1.7 of 2.25 PFLOP/s for large shapes (0.72-0.76).
    gemm_bf16=0.75,
    # MXFP8 on Blackwell: the block scales are consumed by the tensor cores (no CUDA-core promotion), so large
    # MXFP8 GEMMs reach ~0.70-0.78 of the FP8 peak in cuBLAS; quantisation kernels next to the GEMMs -> 0.70.
    gemm_fp8=0.70,
    # NVIDIA measured its MXFP8 grouped GEMM (multi-stream cuBLAS) for DeepSeek-V3's expert shapes (K = 7,168,
    # N = 2,048) at 2,672 TFLOP/s on GB200 with L2 flushed ("Optimizing DeepSeek-V3 Training Performance on GB200
    # NVL72", Megatron-LM docs). The dense rate the model gives that GB200 GEMM is 5 PF x gemm_fp8 (0.70) x
    # GB200's tensor_sustain (0.879, hardware.CATALOGUE) x shape_factor(7,168, FP8) (0.988) = 3,039: grouped is
    # 2,672 / 3,039 = 0.88 of dense (DeepGEMM's grouped kernels are 0.9 of its dense ones on Hopper).
    grouped_gemm=0.88,
    # cuDNN / FlashAttention-4 on B200: forward ~1.6 of 2.25 PFLOP/s BF16 (0.7), backward ~0.45 -> 0.50 overall.
    attention=0.50,
    sfu=0.80,
    # Blackwell's HBM3e reaches ~0.9 of 8 TB/s in copies; same access-pattern discount as Hopper.
    hbm=0.70,
    # NVLink 5 all-to-all (HybridEP / NCCL on NVL72): ~0.75 of the 900 GB/s per direction.
    nvlink=0.75,
    nic=0.85,  # same RDMA goodput as Hopper (ConnectX-7/8)
    a2a_latency_s=30e-6,
    comm_sm_share=0.20,  # HybridEP / DeepEP SM budget of ~24-32 of 148 SMs
    # cuBLAS BF16 on a B200, M = N = 8,192 (pytorch-labs/tritonbench PR #1011): K = 1,024 / 2,048 / 4,096 / 8,192
    # at 714 / 839 / 915 / 959 TFLOP/s; each K against 8,192 gives K0 = 421 / 409 / 415. FP8: 415 x 2 x 0.70 /
    # 0.75 = 775 (tile_k0); the MXFP8 GEMMs of facebookexperimental/triton PR #2803 (B200) at K = 512 and
    # K ~ 1,024 run at 0.51 and 0.63 of their 4,096^3 rate, where the shape factor gives 0.47 and 0.68.
    gemm_k0=415.0,
    # torchao's MXFP8 grouped GEMM on a B200 at DeepSeek-V3 expert shapes (131,072 tokens in 8 groups, 7,168 ->
    # 2,048; pytorch/ao torchao/prototype/moe_training/README.md, "MXFP8 Kernel Breakdown by Pass"): forward
    # (K = 7,168) and data gradient (K = 2,048) 1,838.1 us each = 2,094 TFLOP/s, weight gradient (K = 16,384
    # tokens a group) 2,412.4 us = 1,595. The shape factor runs that forward / data-gradient pair at 0.880 of the
    # rate at GEMM_REF_K and the weight gradient at 1.045: 2,486 expected, so 1,595 / 2,486 = 0.64. (torchao times
    # the pair's two passes alike, where the shape factor puts K = 2,048 20% below K = 7,168; the total matches.)
    wgrad_fp8=0.64,
    # HybridEP's GB200 table at the recipes' 32 SMs, kernel time (deepseek-ai/DeepEP docs/README_Hybrid-EP.md;
    # 4,096 tokens, hidden 7,168, top-8): each EP size dispatches the same tokens as FP8 rows of 7,392 bytes (7,168 +
    # 56 FP32 scales) and as BF16 rows of 14,336 bytes; the two rates give a byte rate (779-918 GB/s) and a time per
    # row: 1.40 / 1.87 / 3.49 / 4.56 / 7.06 ns at EP 8 / 16 / 24 / 32 / 36, median 3.49 ns. Kernel time, not the
    # table's Torch-API time (5.2-10.4 ns, byte rates 480-550 GB/s for BF16): Megatron's path reaches kernel rates
    # (the Megatron-LM GB200 guide: 714.66 GB/s with 32 blocks), and so does ``nvlink`` (0.75 of 900 GB/s).
    a2a_row_s=3.49e-9,
)

#: CPU (the local machine; rates measured by ``moetrain bench``, so these are relative to measurements).
CPU = Efficiency(
    generation="cpu",
    # The measured n x n matmul curve already holds the size effect; the GEMMs of a training step also pay for
    # transposed operands, strided views and autograd bookkeeping that an isolated matmul does not: 0.8.
    gemm_bf16=0.80,
    gemm_fp8=0.80,
    # Expert GEMMs under gloo EP are a Python loop or a grouped kernel over small per-expert batches: 0.6.
    grouped_gemm=0.60,
    # Attention on CPU: batched GEMMs plus a softmax over L x L (SDPA's fused CPU kernel or its math path).
    # (Used for models whose code is not counted; for moetrain's own model the softmax elements are counted --
    # moetrain.plan.counts -- and the attention GEMMs run at ``gemm_bf16``.)
    attention=0.50,
    sfu=1.0,
    # Elementwise PyTorch CPU kernels vs a measured large copy, when the bytes come from the fused-kernel formulas
    # of the model: eager PyTorch moves more (unfused, fp32, allocation), 0.5. Bytes counted on moetrain's own code
    # (moetrain.plan.counts) are the eager traffic itself and are charged at the measured copy rate, no factor.
    hbm=0.50,
    # The bench measures gloo all-to-all between local processes directly; take it as is.
    nvlink=1.0,
    nic=1.0,
    a2a_latency_s=200e-6,  # used only when the bench file has no latency
    comm_sm_share=0.0,  # gloo communication does not take compute cores away from a blocking step
)

BY_GENERATION: dict[str, Efficiency] = {e.generation: e for e in (HOPPER, BLACKWELL, CPU)}


def efficiency_for(generation: str) -> Efficiency:
    try:
        return BY_GENERATION[generation]
    except KeyError:
        raise ValueError(f"no efficiency constants for generation {generation!r}; known: {sorted(BY_GENERATION)}"
                         ) from None


# ---- generation-independent constants (properties of the training algorithm / software, not of a GPU) --------

#: Backward of an elementwise op reads the saved input and the incoming gradient and writes the outgoing
#: gradient: twice the bytes of the forward, so a layer's memory-bound traffic is 3x its forward traffic.
ELEMENTWISE_BWD_TO_FWD = 2.0

#: Memory that is not weights, gradients, optimizer state or activations: CUDA context, NCCL and all-to-all
#: buffers (HybridEP/DeepEP reserve ~1-2 GiB), cuBLAS/cuDNN workspaces.
RESERVED_GIB = 4.0

#: The same for one CPU training process (local runs): the Python interpreter with torch, torch.distributed and
#: moetrain imported measures 0.23 GB resident on the bench machine; gloo buffers and allocator slack on top.
RESERVED_GIB_CPU = 0.5

#: Step-time ratio of unforced ("real") routing to forced-balanced routing when the plan gives no imbalance
#: factor. The published statement is about the *step*: unforced routing is 8-20% slower than forced balance
#: (docs/reference.md section 4); 1.15 is the middle of that range. The model does not multiply the step by it:
#: :func:`moetrain.plan.model.predict` raises the per-rank max/mean load (``Plan.imbalance``) until the plan's
#: step is this much slower than the same plan forced-balanced, so the extra time lands where imbalance acts
#: (grouped expert GEMMs, all-to-all, permutes, their overlap) and the activation memory grows with it.
#: (Until this revision the value was used directly as the max/mean load; that slows only the expert kernels and
#: made the step 6-8% slower on the published plans -- at or below the low end of the published range.)
REAL_ROUTING_SLOWDOWN = 1.15

#: Bytes per element of a block-scaled FP8 tensor on the wire or in memory: 1 byte + one 4-byte scale per 128
#: elements (DeepSeek 1x128 tiles; MXFP8's 1-byte scale per 32 elements is the same 1/32).
FP8_BYTES = 1.0 + 1.0 / 32

#: Host time to launch one CUDA kernel from C++ (driver + runtime call) on an x86 host: about 4-6 us measured on
#: a current driver (xiaguan/cuda-kernel-launch-lab; NVIDIA's "Getting Started with CUDA Graphs" blog measures
#: the same order); docs/reference.md section 12. It is what a kernel costs that a C++ loop launches without a
#: Python call each (the per-expert GEMMs and quantisations of an eager grouped GEMM). Whole-iteration CUDA graphs
#: replay the kernels with no host call each, so a run with them pays none of it.
HOST_S_PER_KERNEL = 5e-6

#: Host time of one eager PyTorch operator that launches one kernel (Python, dispatcher, launch), by host CPU:
#: a torch.nn.Linear forward takes 13.48 us of CPU time on an H100 DGX (Xeon Platinum 8480C) and 37.08 us on a
#: GB200 (Grace) (TransformerEngine issue #2053, "High CPU overhead on Grace systems", BF16, hidden 2,048, 8,192
#: tokens). Every counted kernel of an eager block (KERNELS_FWD) costs this; Transformer Engine's modules cost
#: more per call (99.66 us for te.Linear on the same GB200), which is not charged.
HOST_S_PER_OP = {"x86": 13.48e-6, "grace": 37.08e-6}

#: Kernels an eager grouped expert MLP launches per local expert in one forward + backward (Megatron's
#: TEGroupedMLP over Transformer Engine's GroupedLinear, which quantises each expert's rows and runs one GEMM per
#: expert): forward fc1 and fc2 GEMMs, backward a data- and a weight-gradient GEMM of each (6); under FP8 each
#: GEMM input is quantised per expert as well (forward 2, backward 2: +4). Launched from C++ in a loop, so each
#: costs HOST_S_PER_KERNEL (scaled to the host CPU as HOST_S_PER_OP scales). Full-iteration graphs or a fused
#: grouped-MLP kernel (the 26.06 recipes) launch none of them per expert.
KERNELS_PER_EXPERT = {"bf16": 6, "fp8": 10}

#: Kernels one forward of a block launches in a fused Megatron / TE stack, counted from its operations (norm,
#: projections, RoPE, attention, casts, residual; router, top-k, permute, dispatch, grouped GEMMs, activation,
#: combine, unpermute, shared expert); the backward launches about twice as many. Graphable parts
#: (attention, router, preprocess: Megatron ``cuda_graph_scope``) become one launch each under partial graphs.
KERNELS_FWD = {"attention": 30, "moe_static": 20, "moe_dynamic": 25, "ffn": 8, "head": 6, "embedding": 2}

#: SMs the expert-dispatch kernels hold while they run, by dispatcher (what an overlapped compute stream loses):
#: HybridEP 32 (the record recipe's setting, docs/reference.md section 8); DeepEP as DeepSeek-V3 ran it 20 of 132
#: (report sec. 3.2.2); NCCL all-to-all / all-gather (Megatron ``alltoall`` / ``allgather``): no published figure,
#: assumed the same 32 as HybridEP. Divided by the GPU's SM count (``GPUSpec.sm_count``) this replaces the
#: generation's ``comm_sm_share`` for catalogue GPUs.
COMM_SMS = {"flex": 32, "flex-deepseek": 20, "alltoall": 32, "allgather": 32}

#: Monte-Carlo samples used to estimate the number of distinct destination ranks / domains per token.
ROUTING_SAMPLES = 4096


def all_constants() -> dict[str, object]:
    """Every constant, for reports and the JSON output."""
    return {
        "generations": {g: e.to_dict() for g, e in BY_GENERATION.items()},
        "GEMM_REF_K": GEMM_REF_K,
        "A2A_REF_ROW_BYTES": A2A_REF_ROW_BYTES,
        "ELEMENTWISE_BWD_TO_FWD": ELEMENTWISE_BWD_TO_FWD,
        "RESERVED_GIB": RESERVED_GIB,
        "RESERVED_GIB_CPU": RESERVED_GIB_CPU,
        "REAL_ROUTING_SLOWDOWN": REAL_ROUTING_SLOWDOWN,
        "FP8_BYTES": FP8_BYTES,
        "HOST_S_PER_KERNEL": HOST_S_PER_KERNEL,
        "HOST_S_PER_OP": dict(HOST_S_PER_OP),
        "KERNELS_PER_EXPERT": dict(KERNELS_PER_EXPERT),
        "KERNELS_FWD": dict(KERNELS_FWD),
        "COMM_SMS": dict(COMM_SMS),
    }
