"""SGLang frontend programs, written as a user would write them against any SGLang server.

Run: `python tests/frontend/programs.py http://127.0.0.1:PORT`.
Prints one JSON object with what each program produced; the test checks it.
"""

import json
import sys

import sglang as sgl


@sgl.function
def qa(s, question):
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", max_tokens=12, stop="\n", temperature=0)


@sgl.function
def capped(s, prompt):
    s += prompt
    s += sgl.gen("out", max_tokens=6, temperature=0)


@sgl.function
def pick_color(s):
    s += "My favourite colour is"
    s += sgl.select("color", choices=[" red", " blue", " green"])


@sgl.function
def branches(s):
    s += "List two things.\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Thing {i + 1}:" + sgl.gen("thing", max_tokens=5, temperature=0)
    s += "First:" + forks[0]["thing"] + "\nSecond:" + forks[1]["thing"]


@sgl.function
def chat(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("reply", max_tokens=6, temperature=0))


PERSON_SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
})


@sgl.function
def structured(s):
    s += "Phone number: " + sgl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=16, temperature=0)
    s += "\nAnswer: " + sgl.gen("answer", regex=r"(yes|no)", temperature=0)
    s += "\nPerson: " + sgl.gen("person", json_schema=PERSON_SCHEMA, max_tokens=128, temperature=0)
    s += "\nAge: " + sgl.gen_int("age", max_tokens=4)
    s += "\nMood:" + sgl.select("mood", choices=[" happy", " sad"])


def main(url):
    backend = sgl.RuntimeEndpoint(url)
    sgl.set_default_backend(backend)
    out = {"model_name": backend.get_model_name()}

    state = qa.run(question="What is one plus one?")
    out["qa"] = {"answer": state["answer"], "text": state.text(), "meta": state.get_meta_info("answer")}

    state = capped.run(prompt="Once upon a time")
    out["capped"] = state["out"]

    stream = qa.run(question="Say something.", stream=True)
    out["stream_pieces"] = list(stream.text_iter("answer"))
    out["stream_final"] = stream["answer"]

    states = qa.run_batch([{"question": "Who?"}, {"question": "Where?"}, {"question": "What is one plus one?"}])
    out["batch"] = [s["answer"] for s in states]

    state = pick_color.run()
    out["select"] = state["color"]

    state = branches.run()
    out["fork"] = {"text": state.text()}

    state = chat.run(question="Hi there")
    out["chat"] = state["reply"]

    state = structured.run()
    out["structured"] = {k: state[k] for k in ("phone", "answer", "person", "age", "mood")}
    out["structured"]["text"] = state.text()

    out["server_info_ok"] = "version" in backend.get_server_info()
    backend.flush_cache()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
