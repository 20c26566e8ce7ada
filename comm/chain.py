"""The optimizer chain moved to pipezero/chain.py (a root module: it is not communication); kept for imports."""

from pipezero.chain import ChainLink, ChainWrapper, chain_step, check_inner, describe, innermost, links

__all__ = ["ChainLink", "ChainWrapper", "describe", "check_inner", "chain_step", "innermost", "links"]
