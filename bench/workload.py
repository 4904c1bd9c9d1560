"""What the load benches ask and how they summarise it: one list of questions, one percentile.

`bench/throughput.py` (engine in-process) and `bench/http_load.py` (over HTTP) send the same
questions, so their tables describe the same work.
"""

from __future__ import annotations

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Describe the water cycle to a child.",
    "List some uses of copper and why.",
    "What makes bread rise?",
    "Tell me about the history of the telescope.",
    "How do bees communicate?",
    "Why is the sky blue?",
    "Describe a busy market in the morning.",
    "How does a refrigerator keep food cold?",
    "Write a poem about autumn leaves.",
    "Explain what a prime number is.",
    "What do volcanoes do?",
    "How are rainbows formed?",
    "Describe the life of a river.",
    "What is a good breakfast and why?",
]


def pct(values, q):
    """The q-quantile (0..1) of values by nearest rank; NaN when there are none."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
