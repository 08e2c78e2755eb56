"""Log-probabilities of sampled tokens, for the requests that ask (`SamplingParams.logprobs = K`).

Which distribution: the log-softmax of the logits the token was drawn from, at temperature 1 and
before top-k / top-p / min-p, over the tokens the row was allowed to pick: a constraint's grammar
mask and the min_tokens bans are applied first (a disallowed token has probability 0 and is never
listed as an alternative). For a row without a constraint or bans this is exactly the model's raw
distribution, which is what the OpenAI API reports. Temperature and the filters change which token
is drawn, never the reported numbers, so a sampled token can have a low logprob and be missing from
its own top K.

Cost: nothing for a step where no row asks. Otherwise, for the rows that ask only, right after
sampling and on the device: one row gather, a float32 logsumexp, a top-K and a gather of the chosen
token; the results are copied to the host with the sampled tokens (the same event: no extra sync).
The logits come from the model's own head in the model's dtype; the sums run in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from batchinfer.engine.request import TokenLogprob


@dataclass
class StepLogprobs:
    """One step's logprobs for the sampling rows that asked.

    rows[i] (a sampling row of the step) asked for ks[i] alternatives; values[i] holds its chosen
    token's logprob, then the step's largest K's logprobs (best first); ids[i] those tokens' ids.
    """

    rows: list[int]
    ks: list[int]
    values: torch.Tensor  # float32 [R, 1 + max(ks)]
    ids: torch.Tensor  # int64 [R, max(ks)]
    _host: tuple[list[list[float]], list[list[int]]] | None = field(default=None, repr=False)
    _index: dict[int, int] = field(default_factory=dict, repr=False)

    def to_host_async(self) -> "StepLogprobs":
        """The same numbers copied into pinned host memory without blocking (record an event after)."""
        if self.values.device.type == "cpu":
            return self
        values = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
        ids = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
        values.copy_(self.values, non_blocking=True)
        ids.copy_(self.ids, non_blocking=True)
        return StepLogprobs(self.rows, self.ks, values, ids)

    def entry(self, row: int, token_id: int) -> TokenLogprob | None:
        """The TokenLogprob of sampling row `row` (None if it did not ask). Call once the copy is done."""
        if self._host is None:
            self._host = (self.values.tolist(), self.ids.tolist())
            self._index = {r: i for i, r in enumerate(self.rows)}
        i = self._index.get(row)
        if i is None:
            return None
        values, ids = self._host[0][i], self._host[1][i]
        k = min(self.ks[i], len(ids))
        top = tuple((ids[j], values[1 + j]) for j in range(k) if values[1 + j] != -math.inf)
        return TokenLogprob(token_id, values[0], top)


def step_logprobs(logits: torch.Tensor, asks: list[tuple[int, int]], tokens: torch.Tensor) -> StepLogprobs:
    """Logprobs of the sampled `tokens` [B] under `logits` [B, V] (bans and masks already applied)
    for the rows in `asks` (row, K); see the module docstring for the distribution."""
    rows = [r for r, _ in asks]
    ks = [k for _, k in asks]
    index = torch.tensor(rows, dtype=torch.int64)
    if logits.is_cuda:  # pinned, so the copy does not wait for the device
        index = index.pin_memory()
    index = index.to(logits.device, non_blocking=True)
    x = logits.index_select(0, index).float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = x.gather(1, tokens.index_select(0, index).view(-1, 1)) - lse
    kmax = min(max(ks), x.shape[1])
    if kmax:
        top_values, top_ids = torch.topk(x, kmax, dim=-1, largest=True, sorted=True)
        values = torch.cat([chosen, top_values - lse], dim=1)
    else:
        values, top_ids = chosen, torch.empty((len(rows), 0), dtype=torch.int64, device=x.device)
    return StepLogprobs(rows, ks, values, top_ids)
