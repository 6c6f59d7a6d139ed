"""Test-only draft sources (docs/speculation-cases.md B25): always-wrong drafts, and right-then-wrong drafts."""

from specserve.spec_decode.proposer import Proposal


class WrongProposer:
    """Proposes k tokens that the greedy target never picks: the true next token plus one (mod vocab),
    computed from a reference greedy run (`truth`: request prompt tuple -> greedy continuation).
    With `first_right`, the first draft is the true token and the rest are wrong."""

    method = "ngram"

    def __init__(self, truth: dict, vocab: int, first_right: bool = False):
        self.truth, self.vocab, self.first_right = truth, vocab, first_right
        self.proposed: list[list[int]] = []

    def propose(self, inputs):
        out = []
        for inp in inputs:
            cont = None
            for prompt, c in self.truth.items():
                if tuple(inp.token_ids[: len(prompt)]) == prompt:
                    cont = c
                    pos = len(inp.token_ids) - len(prompt)
            drafts = []
            if cont is not None:
                for j in range(inp.num_speculative_tokens):
                    t = cont[pos + j] if pos + j < len(cont) else 0
                    drafts.append(t if (self.first_right and j == 0) else (t + 1) % self.vocab)
            self.proposed.append(drafts)
            out.append(Proposal(drafts, None))
        return out

    def finish_request(self, request_id, token_ids):
        pass
