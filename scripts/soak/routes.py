"""The soak's requests on the newer routes (--all-routes): Responses (plain, streamed, walked away
from, stored and followed up), Messages (plain and streamed), embeddings, and chat with OpenAI's
`prediction`. Each checks what it can of the answer and records an outcome or an error on the soak.
"""

from __future__ import annotations

import json

import aiohttp

MAX_STORED_IDS = 32  # recent stored responses a follow-up may name


class NewRoutes:
    def __init__(self, soak):
        self.soak = soak
        self.rng = soak.rng
        self.stored_ids: list[str] = []

    async def run_one(self, session: aiohttp.ClientSession, model: str) -> None:
        kind = self.rng.choice(["responses", "responses_stream", "messages", "messages_stream", "embeddings",
                                "prediction"])
        if kind.startswith("responses"):
            await self.responses(session, model, stream=kind.endswith("stream"))
        elif kind.startswith("messages"):
            await self.messages(session, model, stream=kind.endswith("stream"))
        elif kind == "embeddings":
            await self.embeddings(session, model)
        else:
            await self.prediction(session, model)

    async def responses(self, session: aiohttp.ClientSession, model: str, stream: bool) -> None:
        asked = self.soak.max_tokens()
        body = {"model": model, "input": self.soak.prompt(), "max_output_tokens": asked, "stream": stream,
                "temperature": self.rng.choice([0.0, 0.7]), "store": self.rng.random() < 0.5,
                "metadata": {"soak": "yes"}}
        if self.stored_ids and self.rng.random() < 0.3:
            body["previous_response_id"] = self.rng.choice(self.stored_ids)
        walk_away = stream and self.rng.random() < 0.2
        async with session.post(self.soak.url + "/v1/responses", json=body) as response:
            if response.status != 200:
                return self.soak.error(f"responses_status_{response.status}", await response.text())
            if not stream:
                return self._check_response("responses", asked, body, await response.json())
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "error":
                    return self.soak.error("responses_stream_error_event", event.get("message", ""))
                if walk_away and event["type"] == "response.output_text.delta":
                    response.close()
                    self.soak.outcomes["aborted_by_client_responses"] += 1
                    return None
                if event["type"] in ("response.completed", "response.incomplete"):
                    return self._check_response("responses_stream", asked, body, event["response"])
            self.soak.error("responses_stream_without_end", "")

    def _check_response(self, kind: str, asked: int, body: dict, response: dict) -> None:
        num_out = response["usage"]["output_tokens"]
        statuses = {item.get("status") for item in response["output"]}
        is_cut = response["status"] == "incomplete"
        if 0 < num_out <= asked and statuses == {"incomplete" if is_cut else "completed"} \
                and response["metadata"] == {"soak": "yes"}:
            self.soak.outcomes[f"served_{kind}"] += 1
            self.soak.num_tokens += num_out
            if body["store"]:
                self.stored_ids = (self.stored_ids + [response["id"]])[-MAX_STORED_IDS:]
        else:
            self.soak.error(f"{kind}_bad_answer", json.dumps(response)[:300])

    async def messages(self, session: aiohttp.ClientSession, model: str, stream: bool) -> None:
        asked = self.soak.max_tokens()
        body = {"model": model, "max_tokens": asked, "stream": stream, "temperature": 0.0,
                "messages": [{"role": "user", "content": self.soak.prompt()}]}
        async with session.post(self.soak.url + "/v1/messages", json=body) as response:
            if response.status != 200:
                return self.soak.error(f"messages_status_{response.status}", await response.text())
            if not stream:
                answer = await response.json()
                return self._check_count("messages", asked, answer["usage"]["output_tokens"], answer["stop_reason"])
            num_out, stop_reason, kind = None, None, None
            async for line in response.content:
                if line.startswith(b"event: "):
                    kind = line[7:].strip().decode()
                elif line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if kind == "error":
                        return self.soak.error("messages_stream_error_event", json.dumps(event)[:300])
                    if kind == "message_delta":
                        num_out, stop_reason = event["usage"]["output_tokens"], event["delta"]["stop_reason"]
            self._check_count("messages_stream", asked, num_out, stop_reason)

    def _check_count(self, kind: str, asked: int, num_out: int | None, stop_reason: str | None) -> None:
        if num_out is not None and 0 < num_out <= asked and (stop_reason == "max_tokens") == (num_out == asked):
            self.soak.outcomes[f"served_{kind}"] += 1
            self.soak.num_tokens += num_out
        else:
            self.soak.error(f"{kind}_bad_answer", f"asked {asked}, got {num_out} ({stop_reason})")

    async def embeddings(self, session: aiohttp.ClientSession, model: str) -> None:
        inputs = [self.soak.prompt() for _ in range(self.rng.randint(1, 4))]
        async with session.post(self.soak.url + "/v1/embeddings", json={"model": model, "input": inputs}) as response:
            if response.status != 200:
                return self.soak.error(f"embeddings_status_{response.status}", await response.text())
            data = (await response.json())["data"]
            if [d["index"] for d in data] == list(range(len(inputs))) and len({len(d["embedding"]) for d in data}) == 1:
                self.soak.outcomes["served_embeddings"] += 1
            else:
                self.soak.error("embeddings_bad_answer", json.dumps(data)[:300])

    async def prediction(self, session: aiohttp.ClientSession, model: str) -> None:
        asked = self.soak.max_tokens()
        prompt = self.soak.prompt()
        body = {"model": model, "messages": [{"role": "user", "content": f"Repeat: {prompt}"}], "max_tokens": asked,
                "ignore_eos": True, "temperature": 0.0, "prediction": {"type": "content", "content": prompt}}
        async with session.post(self.soak.url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                return self.soak.error(f"prediction_status_{response.status}", await response.text())
            usage = (await response.json())["usage"]
            # As OpenAI's, completion_tokens counts the rejected prediction tokens too: the answer is the rest.
            num_rejected = (usage.get("completion_tokens_details") or {}).get("rejected_prediction_tokens", 0)
            self.soak.usage.add(usage, self.soak.args.block_size)
            self.soak.check_count("prediction", asked, usage["completion_tokens"] - num_rejected)
