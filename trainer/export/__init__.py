"""Taking a trained policy out of a run: `python -m trainer export` writes a PEFT adapter folder or a merged Hugging
Face model folder with a model card (source.py picks the adapter and the base, weights.py writes the weights,
card.py the card, hub.py uploads), and `python -m trainer serve` answers with it behind an OpenAI-compatible port
(serve.py)."""
