"""Model families the MRV2 runner implements itself, keyed by transformers architecture name."""

from __future__ import annotations

from pdserve.runner.models.arcee import ArceeForCausalLM
from pdserve.runner.models.cohere import CohereForCausalLM
from pdserve.runner.models.deepseek import DeepseekForCausalLM
from pdserve.runner.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from pdserve.runner.models.gemma import Gemma1ForCausalLM, GemmaForCausalLM
from pdserve.runner.models.glm4 import Glm4ForCausalLM
from pdserve.runner.models.glm4_moe import Glm4MoeForCausalLM
from pdserve.runner.models.gpt_oss import GptOssForCausalLM
from pdserve.runner.models.granite_moe import GraniteMoeForCausalLM
from pdserve.runner.models.llama import LlamaFamilyForCausalLM
from pdserve.runner.models.llama4 import Llama4ForCausalLM
from pdserve.runner.models.mamba_hybrid import (
    BambaForCausalLM,
    GraniteHybridForCausalLM,
    JambaForCausalLM,
    NemotronHForCausalLM,
)
from pdserve.runner.models.minimax_m2 import MiniMaxM2ForCausalLM
from pdserve.runner.models.post_norm import PostNormForCausalLM
from pdserve.runner.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "ArceeForCausalLM": ArceeForCausalLM,  # a Llama with a relu^2 MLP (arcee.py)
    "BambaForCausalLM": BambaForCausalLM,  # Mamba2 + attention hybrid (runner/hybrid.py)
    "Cohere2ForCausalLM": CohereForCausalLM,  # parallel blocks, LayerNorms (cohere.py)
    "CohereForCausalLM": CohereForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Ernie4_5ForCausalLM": LlamaFamilyForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,  # softmax + bias routing
    "Exaone4ForCausalLM": PostNormForCausalLM,
    "GemmaForCausalLM": Gemma1ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,  # GLM-4-0414: sandwich norms (glm4.py)
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GlmForCausalLM": LlamaFamilyForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteForCausalLM": LlamaFamilyForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,  # Granite 3.x MoE (granite_moe.py)
    "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM,  # dense or MoE (runner/hybrid.py)
    "JambaForCausalLM": JambaForCausalLM,  # Mamba1 + attention hybrid (runner/hybrid.py)
    "LlamaForCausalLM": LlamaFamilyForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,  # Llama 4's language model (llama4.py)
    "Ministral3ForCausalLM": LlamaFamilyForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,  # DeepSeek-V3-routed MoE (minimax_m2.py)
    "MinistralForCausalLM": LlamaFamilyForCausalLM,
    "MistralForCausalLM": LlamaFamilyForCausalLM,
    "MixtralForCausalLM": LlamaFamilyForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,  # dense or MoE (runner/hybrid.py)
    "Olmo2ForCausalLM": PostNormForCausalLM,
    "OlmoeForCausalLM": LlamaFamilyForCausalLM,  # OLMoE: q/k norms over all heads, MoE
    "Olmo3ForCausalLM": PostNormForCausalLM,
    "Phi3ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2MoeForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3MoeForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,  # Gated DeltaNet hybrid (runner/hybrid.py)
    "SeedOssForCausalLM": LlamaFamilyForCausalLM,
    "SmolLM3ForCausalLM": LlamaFamilyForCausalLM,
    # Base models without an LM head (embedding checkpoints such as Qwen3-Embedding's):
    # they serve embeddings only (runner/pooling.py; `pooling_only`)
    "LlamaModel": LlamaFamilyForCausalLM,
    "MistralModel": LlamaFamilyForCausalLM,
    "Qwen2Model": LlamaFamilyForCausalLM,
    "Qwen3Model": LlamaFamilyForCausalLM,
    # Classifiers (runner/classify.py): the base model and a `score` head, or a causal LM
    # converted by its config's `classifier_from_token` (Qwen3-Reranker)
    "LlamaForSequenceClassification": LlamaFamilyForCausalLM,
    "MistralForSequenceClassification": LlamaFamilyForCausalLM,
    "Qwen2ForSequenceClassification": LlamaFamilyForCausalLM,
    "Qwen3ForSequenceClassification": LlamaFamilyForCausalLM,
}
