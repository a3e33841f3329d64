"""scaletool: what Multi-head Latent Attention buys over MHA/GQA/MQA, estimated and measured."""
__version__ = "0.1.0"
