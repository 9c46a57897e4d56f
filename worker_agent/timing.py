"""How long a batch's compute took, read when it is ready rather than waited for.

On the CPU a batch is done when its optimizer step returns: the host clock measures it. On
CUDA the step returns as soon as its kernels are queued; waiting for them after every batch
(``torch.cuda.synchronize``) would leave the GPU idle while the host fetches and launches
the next one. Instead each batch records a CUDA event before its forward pass and one
after its optimizer step, and the trainer reads the span (and the loss) once the second
has passed: usually a batch later, when the GPU got there by itself. Events come from a
small pool, so a batch allocates none.
"""

from __future__ import annotations

from typing import Any, Protocol


class Span(Protocol):
    def ready(self) -> bool:
        """Whether its compute is over (reading it now does not wait)."""

    def ms(self) -> float:
        """Its compute time, in milliseconds (waits until it is over)."""


class HostSpan:
    """A span the host clock measured: over when measured."""

    def __init__(self, ms: float) -> None:
        self._ms = ms

    def ready(self) -> bool:
        return True

    def ms(self) -> float:
        return self._ms


class HostClock:
    """The CPU's: the host time from the forward pass to the end of the optimizer step."""

    def begin(self) -> Any:
        return None

    def end(self, _begun: Any, host_ms: float) -> Span:
        return HostSpan(host_ms)


class _CudaSpan:
    def __init__(self, clock: CudaClock, start: Any, stop: Any) -> None:
        self._clock, self._start, self._stop = clock, start, stop
        self._ms: float | None = None

    def ready(self) -> bool:
        return self._ms is not None or bool(self._stop.query())

    def ms(self) -> float:
        if self._ms is None:
            self._stop.synchronize()
            self._ms = float(self._start.elapsed_time(self._stop))
            self._clock.free += [self._start, self._stop]  # both may be recorded again
        return self._ms


class CudaClock:
    """CUDA events on the current stream of ``device``, recorded around each batch."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch, self.device = torch, device
        self.free: list[Any] = []

    def _event(self) -> Any:
        return self.free.pop() if self.free else self._torch.cuda.Event(  # type: ignore[no-untyped-call]
            enable_timing=True)

    def begin(self) -> Any:
        start = self._event()
        start.record(self._torch.cuda.current_stream(self.device))
        return start

    def end(self, begun: Any, _host_ms: float) -> Span:
        stop = self._event()
        stop.record(self._torch.cuda.current_stream(self.device))
        return _CudaSpan(self, begun, stop)


def clock_for(device: Any) -> HostClock | CudaClock:
    return CudaClock(device) if getattr(device, "type", "cpu") == "cuda" else HostClock()
