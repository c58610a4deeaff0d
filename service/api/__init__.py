"""The HTTP API: OpenAI's chat and legacy completions, its Responses API (responses_api/, served as the chat
completions it means), tokenization, models, probes and the chat page.

routes.py is the blueprint: each view parses (chat_request.py, completion_request.py,
tokenize_request.py), checks the cache, calls a serving class (chat.py, completions.py,
tokenizing.py) and responds with the models of responses.py, whole or as Server-Sent Events (sse.py).
The serving classes know the engine's events and OpenAI's objects, and nothing of Flask's request
and response. What they call on the engine is written down once, as the ChatEngine Protocol
(serving.py); the app's state the views read is corechat.Corechat.
"""
