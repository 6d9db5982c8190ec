"""Structured outputs: xgrammar grammars compiled beside the busy loop, one matcher per request.

`GrammarCompilerPool` compiles on worker threads; `RequestGrammar` is a request's
handle (not schedulable until its grammar is ready; a matcher that follows the
accepted tokens); `apply_grammar_masks` masks a step's logits with the matchers'
bitmasks before the draw.
"""

from engine.structured_output.compiler import GrammarCompilerPool
from engine.structured_output.request_grammar import GrammarError, RequestGrammar

__all__ = ["GrammarCompilerPool", "GrammarError", "RequestGrammar"]
