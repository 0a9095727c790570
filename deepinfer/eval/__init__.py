"""Model-quality evaluations of the engine, each one command printing one JSON object:
`python -m deepinfer.eval.<tool>` or `python -m deepinfer.eval <tool>`, TOOLS below; `main(argv) -> int` of
each tool module is its command. See eval/README.md in the source tree."""

TOOLS = ("agreement", "dspark", "perplexity", "replay", "structured")
