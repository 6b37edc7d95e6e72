"""echospec: speculative-decoding LLM service (Python package root).

``echospec.v1`` holds the Python stubs generated from ``protos/echospec/v1``
by ``scripts/gen_protos.py`` (build outputs, never edited by hand).
"""
