"""Model-card templates (installed as hf_moe.model_cards)."""
