"""OLMoE: a mixture of experts (probabilities not divided by their sum) whose q and k norms run over
all of q and all of k before they become heads."""

from webapp.engine.archs.record import Architecture, Experts

ARCHITECTURES = (Architecture(("olmoe",), experts=Experts.ALWAYS, qk_norm_whole=True),)
