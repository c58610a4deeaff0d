"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) over the chat-completions path.

A Responses request is parsed here (request.py), turned into the chat request it means (conversation.py:
instructions, input items and a stored conversation become chat messages, flat function tools become
chat tools, `text.format` becomes `response_format`) and served by the chat serving class underneath:
the same template, limits, grammar, cache, engine and metrics. What is the Responses API's own is the
output (output.py turns the reply's text and tool-call blocks into output items and the typed stream
events), its objects (objects.py) and the stored responses (service/cache/stored_responses.py), which
serving.py ties together.
"""
