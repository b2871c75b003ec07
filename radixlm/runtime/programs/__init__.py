"""Request graphs (the DSL's IR) and their executor, over any connection to a runtime.

Plain data and asyncio only: the DSL (radixlm.lang) runs graphs with it over its backends, and the
server runs graphs it receives (POST /run_program) with it next to the engine. It never imports
the DSL frontend.
"""
