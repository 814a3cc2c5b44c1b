"""The OpenAI-compatible face of the HTTP service (`/openai/v1`): background responses, files, batches and models,
each route a translation onto the gateway's own calls (routes.py), in OpenAI's shapes (shapes.py, stream.py) and
error bodies (errors.py), so the official `openai` client works against taskgate unchanged."""
