"""A reward the tests' random models earn something of (tests/test_rl_layouts.py): the share of digits."""


def digits(samples):
    return [sum(c.isdigit() for c in s["completion"]) / max(len(s["completion"]), 1) for s in samples]


PROMPTS = [{"prompt": p, "answer": a} for p, a in
           (("2+3=", "5"), ("1+1=", "2"), ("4+4=", "8"), ("9-3=", "6"), ("7*2=", "14"), ("10/5=", "2"))]
