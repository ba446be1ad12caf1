"""Everything that knows a transformers model (torch and transformers are imported here).

    layout.py            ``ModelLayout``: a model's experts modules, routers, pre-MoE norms
    routers.py           ``Router``: a layer's router as the gate lookahead ranks experts by it
    loading.py           a model from its folder (whole, or without its routed experts)
    capture.py           ``RoutingRecorder``: the router's choices, token by token
    completion_text.py   ``AfterPrompt``: a completion's text as it reads after its prompt
    growing_text.py      ``GrowingText``: that text read as tokens come, from a recent point
    capture_generate.py  greedy generation over prompts with capture (``stmoe capture``)
    checkpoints.py       random-weight checkpoints of a preset's dimensions (``make-model``)
    train_tiny.py        re-training the shipped model (``stmoe train-tiny``)

Importing this package itself imports nothing heavy.
"""
