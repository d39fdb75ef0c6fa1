"""What ``spyre estimate`` reports (models/estimate.py plans it): each part's
kernels and modelled time, and the whole estimate with its floors, tables and JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class KernelPlan:
    """One kernel of a part as the planner chose it (``sim.KernelReport``)."""

    name: str
    time_s: float
    roofline_s: float
    bottleneck: str
    utilisation: float
    flops: float
    plan: str
    #: its floor on the card as calibrated: operands once at the sustained
    #: bandwidth, or the PE / vector peak (``KernelReport.sustained_roof_s``)
    floor_s: float = 0.0

    @staticmethod
    def of(report) -> KernelPlan:
        return KernelPlan(
            report.name,
            report.time_s,
            report.roofline_time_s,
            report.bottleneck,
            report.utilisation,
            report.flops,
            report.plan,
            report.sustained_roof_s,
        )


@dataclass
class Part:
    """One planned piece of a forward and what the card took for it."""

    name: str
    count: int  # how many times it runs per forward (layers of this kind)
    time_s: float  # modelled time of one run
    kernels: list[tuple[str, float]] = field(default_factory=list)  # (program, s)
    copies_s: float = 0.0  # device copies (re-lays) inside the part
    host_transfers: int = 0  # h2d/d2h transfers inside the part (fallbacks)
    activation_bytes: int = 0  # peak device memory the call allocated
    #: per kernel (in ``kernels`` order): the planner's choices and what the
    #: timing model made of them (``--explain``)
    plans: list[KernelPlan] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.count * self.time_s


@dataclass
class Estimate:
    model: str
    source: str
    config_class: str
    dtype: str
    params: int
    embedding_params: int
    tied_embeddings: bool
    layers: dict[str, int]  # layer kind -> count
    prompt_tokens: int
    cache_len: int
    prefill: list[Part]
    decode: list[Part]
    #: device memory (bytes)
    weights_bytes: int
    extra_weight_bytes: int  # copies the adapter keeps (chunked LM head) + tables
    kv_cache_bytes: int
    activation_bytes: int
    card_memory_bytes: int
    #: physical floors
    peak_bandwidth_Bps: float
    sustained_bandwidth_Bps: float
    peak_flops: float
    decode_bytes: int  # bytes a decode step must read: weights used + KV cache
    prefill_flops: float
    host_fallbacks: int
    plan_wall_s: float
    #: the decoder layers' linear weights: "float16" (as ``dtype``) or an
    #: 8-bit type, one fp32 scale per output channel (QuantizedLinear)
    weights_dtype: str = "float16"
    #: parameters of those quantised weights (the rest stay ``dtype``)
    quantized_params: int = 0
    #: requests per step (every request at the same position)
    batch: int = 1
    #: requests one prefill step packs (``token_budget`` tokens at most), and
    #: the budget (vLLM's ``max_num_batched_tokens``)
    prefill_batch: int = 1
    token_budget: int = 2048
    #: a speculative verification step (k drafts + 1 per request in one
    #: forward, the LM head on every row), planned when ``spec_tokens`` > 0
    verify: list[Part] = field(default_factory=list)
    spec_tokens: int = 0
    #: cards the model is split over (tensor parallel, models/parallel.py);
    #: times, memory and floors above are per card
    tp: int = 1
    #: parameters of the whole model (``params`` is one card's shard)
    model_params: int = 0
    #: device memory one card needs at each valid TP size, and the fewest
    #: cards that fit (None: not even 8)
    per_card_bytes: dict[int, int] = field(default_factory=dict)
    cards_needed: int | None = 1
    #: the host path (sim/hostpath.py, assumed parameters): device-only and
    #: end-to-end timelines of prefill and one decode step
    host_path: dict[str, Any] = field(default_factory=dict)
    #: a mixture of experts: parameters in the routed experts (all resident),
    #: experts per layer, experts per token, and the parameters one token uses
    expert_params: int = 0
    num_experts: int = 0
    top_k: int = 0
    active_params: int = 0
    #: ``--lora``: the decode step with adapters less the step without them
    #: (the LoRA programs and the fusions their ops separate)
    lora_s: float = 0.0

    @property
    def prefill_s(self) -> float:
        return sum(p.total_s for p in self.prefill)

    @property
    def decode_s(self) -> float:
        return sum(p.total_s for p in self.decode)

    @property
    def verify_s(self) -> float:
        return sum(p.total_s for p in self.verify)

    @property
    def memory_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.extra_weight_bytes
            + self.kv_cache_bytes
            + self.activation_bytes
        )

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.card_memory_bytes

    @property
    def decode_floor_s(self) -> float:
        """Bytes a decode step must read / peak LPDDR5 bandwidth (204.8 GB/s)."""
        return self.decode_bytes / self.peak_bandwidth_Bps

    @property
    def decode_floor_sustained_s(self) -> float:
        """The same at the sustained bandwidth the simulator is calibrated to."""
        return self.decode_bytes / self.sustained_bandwidth_Bps

    @property
    def prefill_floor_s(self) -> float:
        """Prefill FLOP / peak fp16 PE throughput."""
        return self.prefill_flops / self.peak_flops

    @property
    def prefill_kernel_floor_s(self) -> float:
        """The prefill's kernels, each at its floor on the card as calibrated
        (``KernelPlan.floor_s``): the least this split into kernels can take,
        however each is planned.  Below it only fewer bytes help: fusing
        kernels, or fewer memory-bound ones."""
        return sum(p.count * sum(k.floor_s for k in p.plans) for p in self.prefill)

    def ratios(self) -> dict[str, float]:
        return {
            "prefill_vs_compute_floor": self.prefill_s / self.prefill_floor_s,
            "prefill_kernel_floors_vs_compute_floor": self.prefill_kernel_floor_s
            / self.prefill_floor_s,
            "decode_vs_peak_bandwidth_floor": self.decode_s / self.decode_floor_s,
            "decode_vs_sustained_bandwidth_floor": self.decode_s / self.decode_floor_sustained_s,
        }

    @property
    def collective_s(self) -> dict[str, float]:
        """Modelled collective time of a prefill and of a decode step (TP > 1)."""
        return {
            phase: sum(p.total_s for p in parts if p.name.startswith("collectives"))
            for phase, parts in (("prefill", self.prefill), ("decode", self.decode))
        }

    def fit_text(self) -> str:
        if self.tp == 1 and self.fits:
            return "fits one card"
        where = "one card" if self.tp == 1 else f"each of {self.tp} cards"
        if self.fits:
            return f"fits {where}"
        n = self.cards_needed
        need = f"needs {n} cards (--tp {n})" if n else "does not fit on 8 cards either"
        return f"does NOT fit {where}: does not fit: {need}"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("prefill", "decode", "verify"):
            for part, obj in zip(d[key], getattr(self, key), strict=True):
                part["total_s"] = obj.total_s
        d.update(
            prefill_s=self.prefill_s,
            decode_s=self.decode_s,
            verify_s=self.verify_s,
            lora_s=self.lora_s,
            memory_bytes=self.memory_bytes,
            fits=self.fits,
            decode_floor_s=self.decode_floor_s,
            decode_floor_sustained_s=self.decode_floor_sustained_s,
            prefill_floor_s=self.prefill_floor_s,
            prefill_kernel_floor_s=self.prefill_kernel_floor_s,
            ratios=self.ratios(),
            collective_s=self.collective_s,
            decode_tokens_per_s_per_request=1 / self.decode_s,
            decode_tokens_per_s=self.batch / self.decode_s,
        )
        return d

    def explain(self) -> str:
        """Each part's kernels as planned: modelled time against the kernel's
        roofline (its FLOP at PE peak or its operands once at peak
        bandwidth) and against its floor on the card as calibrated (operands
        once at the sustained bandwidth), PE/vector utilisation, what bounds
        it, and the planner's core grid and tiles (``sim.timing.plan_text``)."""
        lines = []
        for phase in ("prefill", "decode"):
            parts = getattr(self, phase)
            flops = sum(k.flops * p.count for p in parts for k in p.plans)
            busy = sum(p.total_s for p in parts)
            lines += [
                "",
                f"  {phase}: {busy * 1e3:.3f} ms; matmul FLOP at "
                f"{flops / max(busy, 1e-30) / self.peak_flops:.0%} of PE peak over the whole pass",
                f"    {'kernel':<44} {'us':>9} {'roof us':>9} {'x roof':>6} {'x floor':>7}"
                f" {'util':>5} {'bound':>8}  plan",
            ]
            for p in parts:
                lines.append(f"  {p.name} (x{p.count})")
                for k in p.plans:
                    lines.append(
                        f"    {k.name[:44]:<44} {k.time_s * 1e6:>9.1f} {k.roofline_s * 1e6:>9.1f}"
                        f" {k.time_s / max(k.roofline_s, 1e-30):>5.2f}x"
                        f" {k.time_s / max(k.floor_s, 1e-30):>6.2f}x {k.utilisation:>5.0%}"
                        f" {k.bottleneck:>8}  {k.plan}"
                    )
        return "\n".join(lines)

    def format(self) -> str:
        gb = 1e9
        r = self.ratios()
        kinds = ", ".join(f"{n} x {k}" for k, n in self.layers.items())
        lines = [
            f"{self.model}: {self.config_class} from {self.source}",
            f"  {self.params / 1e9:.2f} B parameters ({self.embedding_params / 1e9:.2f} B embedding"
            f"{', tied to the LM head' if self.tied_embeddings else ''}), {self.dtype} on the card"
            + (
                f" ({self.quantized_params / 1e9:.2f} B decoder-layer weights in "
                f"{self.weights_dtype}, dequantised in LX)"
                if self.quantized_params
                else ""
            )
            + f"; layers: {kinds}",
            *(
                [
                    f"  mixture of experts: {self.num_experts} experts per layer, top {self.top_k}"
                    f" per token; {self.expert_params / 1e9:.2f} B expert parameters, all"
                    f" resident; {self.active_params / 1e9:.2f} B parameters active per token"
                    " (a decode step reads only the routed experts)"
                ]
                if self.expert_params
                else []
            ),
            f"  batch {self.batch}, {self.tp} card{'s' if self.tp > 1 else ''}"
            + (
                f" (tensor parallel; per card below: {self.params / 1e9:.2f} B of "
                f"{self.model_params / 1e9:.2f} B parameters; collectives "
                f"{self.collective_s['prefill'] * 1e3:.3f} ms per prefill, "
                f"{self.collective_s['decode'] * 1e3:.3f} ms per decode step)"
                if self.tp > 1
                else ""
            )
            + (
                f"; prefill {self.prefill_batch} request{'s' if self.prefill_batch > 1 else ''}"
                f" per step ({self.token_budget}-token budget)"
                if self.batch > 1
                else ""
            )
            + f"; decode {1 / self.decode_s:.1f} tokens/s per request, "
            f"{self.batch / self.decode_s:.1f} tokens/s in all",
            "",
            f"  {'':34} {'modelled':>11} {'floor':>11} {'ratio':>6}  floor is",
            f"  {f'prefill, {self.prompt_tokens} tokens':34} {self.prefill_s * 1e3:>8.1f} ms"
            f" {self.prefill_floor_s * 1e3:>8.1f} ms {r['prefill_vs_compute_floor']:>5.2f}x"
            f"  {self.prefill_flops / 1e12:.1f} TFLOP / {self.peak_flops / 1e12:.1f} TFLOP/s (PE peak)",
            f"  {'':34} {'':>11} {self.prefill_kernel_floor_s * 1e3:>8.1f} ms"
            f" {r['prefill_kernel_floors_vs_compute_floor']:>5.2f}x"
            "  its kernels, each at its floor as calibrated (the bound of this kernel split)",
            f"  {f'decode, per token (cache {self.cache_len})':34} {self.decode_s * 1e3:>8.1f} ms"
            f" {self.decode_floor_s * 1e3:>8.1f} ms {r['decode_vs_peak_bandwidth_floor']:>5.2f}x"
            f"  {self.decode_bytes / gb:.2f} GB / {self.peak_bandwidth_Bps / gb:.1f} GB/s"
            " (LPDDR5 peak)",
            f"  {'':34} {'':>11} {self.decode_floor_sustained_s * 1e3:>8.1f} ms"
            f" {r['decode_vs_sustained_bandwidth_floor']:>5.2f}x"
            f"  {self.decode_bytes / gb:.2f} GB / {self.sustained_bandwidth_Bps / gb:.1f} GB/s"
            " (sustained, sim calibration)",
            "",
            f"  device memory: weights {self.weights_bytes / gb:.2f} GB + adapter copies"
            f" {self.extra_weight_bytes / gb:.2f} GB + KV cache {self.kv_cache_bytes / gb:.2f} GB"
            f" + activations {self.activation_bytes / gb:.2f} GB = {self.memory_bytes / gb:.2f} GB"
            f" of {self.card_memory_bytes / gb:.2f} GB: " + self.fit_text(),
            "",
            "  part                                   x  prefill ms   decode ms  kernels",
        ]
        dec = {p.name: p for p in self.decode}
        for p in self.prefill:
            d = dec.get(p.name)
            lines.append(
                f"  {p.name:<36} {p.count:>3} {p.total_s * 1e3:>11.3f} "
                f"{(d.total_s * 1e3 if d else float('nan')):>11.3f}  "
                f"{len(p.kernels)} / {len(d.kernels) if d else 0}"
            )
        pre = {p.name for p in self.prefill}
        for d in self.decode:
            if d.name not in pre:  # decode-only parts
                lines.append(
                    f"  {d.name[:36]:<36} {d.count:>3} {'-':>11} {d.total_s * 1e3:>11.3f}"
                    f"  0 / {len(d.kernels)}"
                )
        lora_s = self.lora_s
        if lora_s:
            lines.append(
                f"  LoRA: {lora_s * 1e3:.3f} ms per decode step, "
                f"{lora_s / (self.decode_s - lora_s):.1%} of the step without adapters (the "
                "layers compiled with the LoRA ops: their programs and the fusions they split; "
                "models/lora_estimate.py)"
            )
        lines.append(
            f"  planned in {self.plan_wall_s:.0f} s wall (compile + timing-only runs);"
            f" host fallbacks: {self.host_fallbacks}"
        )
        lines += self._host_lines()
        return "\n".join(lines)

    def _host_lines(self) -> list[str]:
        h = self.host_path
        if not h:
            return []
        a = h["assumed"]
        out = [
            "",
            f"  host path (assumed: {a['host_dispatch_s'] * 1e6:.1f} us dispatch + "
            f"{a['host_descriptor_bytes']} B descriptors per kernel, "
            f"{'asynchronous' if a['host_async'] else 'synchronous'} issue, "
            f"{a['host_sync_s'] * 1e6:.0f} us per token; sim/hostpath.py)",
        ]
        for key, label in (("prefill", "prefill"), ("decode", "decode, per token")):
            t = h[key]
            out.append(
                f"  {label:<20} device-only {t['device_s'] * 1e3:>8.1f} ms   end-to-end "
                f"{t['end_to_end_s'] * 1e3:>8.1f} ms   ({t['kernels']} kernels, host issue "
                f"{t['host_issue_s'] * 1e3:.1f} ms: {'host' if t['host_bound'] else 'device'}"
                " bound)"
            )
        for name, d in h.get("published", {}).items():
            got = (
                "no host cost reproduces it"
                if d["dispatch_s"] is None
                else (f"host dispatch {d['dispatch_s'] * 1e6:.0f} us per kernel reproduces it")
            )
            out.append(f"  {name}: {d['target_s'] * 1e3:.0f} ms per token: {got}")
        return out
