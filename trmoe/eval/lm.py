"""trmoe's model class for lm-evaluation-harness, registered as `trmoe`:

    lm_eval ... --model trmoe --model_args run=<run dir>,step=<n>,dtype=auto --batch_size 8 --device cpu

(through `trmoe-lm-eval` / `python -m trmoe.eval.harness`, the harness's own command line with this class
registered beside every model the harness knows — `hf` reads an export — or
`lm_eval.simple_evaluate(model="trmoe", ...)` after importing this module). Log-likelihood requests are
scored in batches by one forward each (logits only at the scored positions: never [batch, seq, vocab]);
rolling log-likelihood uses the harness's own disjoint windows; generation uses trmoe.generate (KV cache).
Each request type draws a progress bar on stderr (done / total, rate, ETA) when stderr is a terminal, as the
harness's `hf` model does; `progress=False` (training's downstream columns) draws none.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import lm_eval.models  # noqa: F401  (the harness's own models first: it loads them only into an empty registry)
import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from trmoe.data.tokenizer import Tokenizer, load_tokenizer
from trmoe.errors import UserError
from trmoe.generate import Sampling, generate
from trmoe.load import load_model
from trmoe.model.transformer import TRMoETransformer


def checkpoint_args(run: str | Path | None, step: int | str | None) -> tuple[str | Path, int | None]:
    """`--model_args run=...,step=...` of `--model trmoe` as load_model takes them (step latest, empty or
    absent: the newest); UserError without a run."""
    if run is None:
        raise UserError("--model_args: run=<run dir> is required for --model trmoe")
    if step in (None, "", "latest"):
        return run, None
    try:
        return run, int(step)
    except (TypeError, ValueError):
        raise UserError(f"step={step}: not an integer; allowed: a checkpoint's step, or latest") from None


@register_model("trmoe")
class TRMoELM(TemplateLM):
    def __init__(
        self,
        run: str | Path | None = None,
        step: int | str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int | str = 8,
        max_length: int | str | None = None,
        model: TRMoETransformer | None = None,
        progress: bool | None = None,
        tokenizer: Tokenizer | None = None,
        **_ignored,
    ):
        super().__init__()
        if model is None:
            run, step = checkpoint_args(run, step)
            if str(device).startswith("cuda") and not torch.cuda.is_available():
                device = "auto"  # the harness's default device is cuda:0 even where there is none
            loaded = load_model(run, step, device=device, dtype=dtype)
            # (training with downstream.tasks passes its model: its config was refused at validation)
            loaded.model.refuse_analysis_only("downstream evaluation")
            if not loaded.text_vocab:
                raise UserError(
                    f"run {run}: its model reads neither o200k_base text nor a tokenizer=bpe's "
                    "(model.vocab_size)"
                )
            model, tokenizer = loaded.model, loaded.tokenizer()
        self.model = model.eval()
        # the run's tokenizer (a model passed in: the caller's, by default o200k_base)
        self.enc = tokenizer if tokenizer is not None else load_tokenizer()
        self.eos = self.enc.eos_id
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self.max_length = min(int(max_length or model.spec.max_seq_len), model.spec.max_seq_len)
        self.progress = progress  # None: a bar only on a terminal (tqdm's disable=None)

    def _bar(self, total: int, what: str, disable_tqdm: bool):
        """A bar over `total` requests; none when the harness asks for none, `progress` is False, or stderr
        is not a terminal (a log file would get a line per update)."""
        off = True if disable_tqdm or self.progress is False else None
        return tqdm(total=total, desc=f"trmoe {what}", unit="req", disable=off, leave=True)

    # ---------------------------------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return self.eos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.enc.encode(string, allowed_special="all")

    def tok_decode(self, tokens: list[int]) -> str:
        return self.enc.decode(tokens)

    # ----------------------------------------------------------------------------------- likelihoods

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), whether the continuation is the greedy one) per pair."""
        inputs, spans = [], []
        for context, continuation in pairs:
            whole = (context + continuation)[-(self.max_length + 1) :]
            n = len(continuation)
            inputs.append(whole[:-1])
            spans.append((len(whole) - 1 - n, n))  # positions predicting the continuation
        width = max(len(x) for x in inputs)
        device = self.model.embed.weight.device
        ids = torch.tensor(
            [x + [self.eos] * (width - len(x)) for x in inputs], device=device
        )  # right padding:
        hidden = self.model(ids)  # causal, so the padding never changes a scored position
        rows = torch.cat([hidden[b, start : start + n] for b, (start, n) in enumerate(spans)])
        logp = self.model.logits(rows).float().log_softmax(-1)
        targets = torch.tensor([t for _, c in pairs for t in c], device=device)
        picked = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
        greedy = logp.argmax(-1) == targets
        out, first = [], 0
        for _, n in spans:
            out.append((picked[first : first + n].sum().item(), bool(greedy[first : first + n].all())))
            first += n
        return out

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        # longest first: batches of similar lengths, and a too-long input fails at once
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        with self._bar(len(requests), kwargs.get("what", "loglikelihood"), disable_tqdm) as bar:
            for first in range(0, len(order), self.batch_size):
                batch = order[first : first + self.batch_size]
                scores = self._score([(requests[i][1], requests[i][2]) for i in batch])
                for i, score in zip(batch, scores, strict=True):
                    results[i] = score
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
                bar.update(len(batch))
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for context, continuation in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(tokens, self.eot_token_id, self.max_length, 1),
            ):
                windows.append((None, context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        scored = self._loglikelihood_tokens(windows, disable_tqdm, what="rolling windows")
        for index, (logp, _) in zip(owner, scored, strict=True):
            totals[index] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = defaultdict(list)  # requests with the same settings decode together
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        results: list[str] = [""] * len(requests)
        bar = self._bar(len(requests), "generate_until", disable_tqdm)
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = min(int(kwargs.pop("max_gen_toks", 256)), self.max_length - 1)
            sample = bool(kwargs.pop("do_sample", False)) and float(kwargs.get("temperature", 1.0)) > 0
            s = Sampling(
                max_new_tokens=max_new,
                greedy=not sample,
                temperature=float(kwargs.get("temperature", 1.0)) if sample else 1.0,
                top_k=int(kwargs.get("top_k", 0) or 0),
                top_p=float(kwargs.get("top_p", 1.0) or 1.0),
                seed=int(kwargs.get("seed", 0) or 0),
            )
            room = max(self.max_length - max_new, 1)
            for first in range(0, len(members), self.batch_size):
                batch = members[first : first + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in batch]

                def done(_row: int, new: list[int], until: list[str] = until) -> bool:
                    return bool(until) and any(stop in self.tok_decode(new) for stop in until)

                for i, new in zip(
                    batch, generate(self.model, prompts, s, eos_id=self.eos, done=done), strict=True
                ):
                    text = self.tok_decode([t for t in new if t != self.eos])
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return results
