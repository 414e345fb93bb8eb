import re
import sqlite3
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import mode
from tuichat.store import SCHEMA_VERSION, Store, StoreError


@pytest.fixture
def path(tmp_path):
    return tmp_path / "history.sqlite3"


@pytest.fixture
def store(path):
    store = Store(path)
    yield store
    store.close()


def chat(store, title, *turns, model="m"):
    conversation = store.create_conversation(title, model)
    for role, content in turns:
        store.add_message(conversation, role, content)
    return conversation


def test_default_location_is_the_data_dir(user_dirs):
    store = Store()
    store.close()
    assert store.path == user_dirs.data / "history.sqlite3" and store.path.exists()


def with_wal(path):
    return [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]


def test_the_history_is_private_under_a_permissive_umask(tmp_path, permissive_umask):
    store = Store()  # in TUICHAT_DATA_DIR, which does not exist yet
    store.add_message(store.create_conversation("Diary", "m"), "user", "a secret")
    files = with_wal(store.path)
    assert all(file.exists() for file in files)  # the connection is open: the WAL and its index are there
    assert mode(tmp_path / "data") == 0o700
    assert [mode(file) for file in files] == [0o600] * 3
    store.close()


def test_files_an_older_tuichat_left_readable_are_made_private_on_open(tmp_path, permissive_umask):
    data = tmp_path / "data"
    data.mkdir()
    older = sqlite3.connect(data / "history.sqlite3")  # as before the fix: created under the umask
    older.execute("PRAGMA journal_mode = WAL")
    older.execute("CREATE TABLE old_notes (text TEXT)")
    files = with_wal(data / "history.sqlite3")
    assert mode(data) == 0o755 and [mode(file) for file in files] == [0o644] * 3

    store = Store()
    assert mode(data) == 0o700
    assert [mode(file) for file in files] == [0o600] * 3
    store.close()
    older.close()


def test_migrates_a_version_1_file_keeping_its_data(path):
    # What the first release wrote, by hand, so the test does not depend on the module's copy of it.
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE conversations (id TEXT PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL,
            is_open INTEGER NOT NULL DEFAULT 1, position INTEGER NOT NULL DEFAULT 0,
            created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL, content TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'done', created REAL NOT NULL);
        CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
        CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO conversations VALUES ('c1', 'Old chat', 'smollm2-135m', 1, 0, 100.0, 200.0);
        INSERT INTO messages VALUES (1, 'c1', 'user', 'What is a platypus?', 'done', 150.0);
        INSERT INTO messages VALUES (2, 'c1', 'assistant', 'An egg-laying mammal.', 'streaming', 160.0);
        INSERT INTO settings VALUES ('theme', 'tuichat-light');
        PRAGMA user_version = 1;
        """
    )
    db.close()

    store = Store(path)
    assert [c.title for c in store.conversations()] == ["Old chat"]
    messages = store.messages("c1")
    assert [(m.id, m.role, m.content, m.meta) for m in messages] == [
        (1, "user", "What is a platypus?", {}),
        (2, "assistant", "An egg-laying mammal.", {}),
    ]
    assert messages[1].status == "stopped"
    assert store.get_setting("theme") == "tuichat-light"
    # Old rows were indexed by the migration, new ones by the triggers.
    assert [hit.message_id for hit in store.search("platypus")] == [1]
    new = store.add_message("c1", "user", "And a platypus bill?", meta={"n": 1})
    assert {hit.message_id for hit in store.search("platypus")} == {1, new}
    store.close()

    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 2
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_a_file_from_a_newer_tuichat_or_not_a_database_is_refused_clearly(path, tmp_path):
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer tuichat"):
        Store(path)
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError, match="garbage.sqlite3"):
        Store(garbage)


def test_search_finds_words_in_user_and_assistant_messages(store):
    fruit = chat(store, "Fruit", ("user", "Tell me about bananas"), ("assistant", "Bananas are berries, café-grown."))
    chat(store, "Cars", ("user", "Which car is fastest?"), ("assistant", "That depends on the track."))

    hits = store.search("bananas")
    assert {(h.conversation_id, h.title, h.role) for h in hits} == {(fruit, "Fruit", "user"), (fruit, "Fruit", "assistant")}
    assert all("ananas" in h.snippet.lower() for h in hits)
    assert [h.role for h in store.search("track")] == ["assistant"]
    assert [h.role for h in store.search("fast")] == ["user"]  # the word being typed is a prefix
    assert [h.role for h in store.search("cafe")] == ["assistant"]  # accents ignored
    assert [h.role for h in store.search("berries grown")] == ["assistant"]  # every word must match
    assert store.search("bananas track") == []
    assert store.search("   ") == []
    assert len(store.search("bananas", limit=1)) == 1


def test_search_treats_quotes_and_operators_in_user_text_as_words(store):
    chat(store, "Quotes", ("user", 'He said "hello" NOT once AND (maybe) near c++ col:umn'), ("assistant", "ok"))
    for query in ['"hello"', '"hello', "NOT", "AND", "once NOT hello", "(maybe", "c++", "col:umn", "-said", "he*",
                  "^he", "NEAR(", "NEAR( maybe", 'he "', "hello ()", "once *", 'said "\0"']:
        assert [h.role for h in store.search(query)] == ["user"], query
    # Punctuation is not indexed: alone it finds nothing (and is no syntax error either).
    for query in ['"', "*", "()", "'", "-", "\0", '"\0"']:
        assert store.search(query) == [], query


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text())
def test_any_text_searched_finds_the_message_holding_it_and_nothing_else(store, text):
    message = store.add_message(chat(store, "t"), "user", text)
    try:
        hits = {hit.message_id for hit in store.search(text)}
        assert hits <= {message}  # the only message there
        if re.search("[A-Za-z0-9]", text):  # a word the tokenizer keeps, whatever its Unicode tables
            assert hits == {message}
    finally:
        store.delete_message(message)


def test_search_index_follows_edits_and_deletes(store):
    conversation = chat(store, "t")
    message = store.add_message(conversation, "assistant", "draft about otters", status="streaming")
    store.update_message(message, content="final text about beavers")
    assert store.search("otters") == [] and [h.message_id for h in store.search("beavers")] == [message]
    store.update_message(message, status="done", meta={"ttft_ms": 12.5})
    assert [h.message_id for h in store.search("beavers")] == [message]
    store.delete_message(message)
    store.delete_message(message)  # twice is fine
    assert store.search("beavers") == [] and store.messages(conversation) == []


def test_messages_round_trip_in_order_with_meta(store):
    conversation = chat(store, "t", ("system", "Be brief."), ("user", "Hi"))
    reply = store.add_message(conversation, "assistant", "", status="streaming", meta={"ttft_ms": 30.0})
    store.update_message(reply, content="Hello!")
    store.update_message(reply, status="done", meta={"ttft_ms": 30.0, "tokens_per_s": 41.5})
    messages = store.messages(conversation)
    assert [(m.role, m.content, m.status) for m in messages] == [
        ("system", "Be brief.", "done"),
        ("user", "Hi", "done"),
        ("assistant", "Hello!", "done"),
    ]
    assert messages[-1].meta == {"ttft_ms": 30.0, "tokens_per_s": 41.5}


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_new_message_moves_its_conversations_updated_time(path):
    clock = Clock(1000.0)
    store = Store(path, clock=clock)
    conversation = store.create_conversation("t", "m")
    clock.now = 1250.0
    store.add_message(conversation, "user", "Hi")
    row = store.conversation(conversation)
    assert (row.created, row.updated) == (1000.0, 1250.0)
    assert store.messages(conversation)[0].created == 1250.0
    store.close()


class CountingConnection:
    def __init__(self, conn):
        self.conn, self.statements = conn, []

    def execute(self, sql, *args):
        self.statements.append(sql)
        return self.conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_update_message_is_one_statement_committed_at_once(store, path):
    reply = store.add_message(chat(store, "t"), "assistant", "", status="streaming")
    store._conn = counting = CountingConnection(store._conn)
    store.update_message(reply, content="partial", meta={"tokens": 3})
    assert len(counting.statements) == 1 and counting.statements[0].startswith("UPDATE messages")
    # Already committed: another connection (another tuichat, or the file after a crash) sees it.
    other = sqlite3.connect(path)
    assert other.execute("SELECT content, meta FROM messages WHERE id = ?", (reply,)).fetchone() == (
        "partial",
        '{"tokens": 3}',
    )
    other.close()


def test_unknown_ids_and_bad_values_raise(store):
    conversation = chat(store, "t")
    with pytest.raises(KeyError):
        store.conversation("nope")
    with pytest.raises(KeyError):
        store.add_message("nope", "user", "x")
    with pytest.raises(KeyError):
        store.update_message(12345, content="x")
    with pytest.raises(KeyError):
        store.rename("nope", "x")
    with pytest.raises(ValueError):
        store.add_message(conversation, "user", "x", status="finished")
    with pytest.raises(ValueError):
        store.add_message(conversation, "robot", "x")
    assert store.messages(conversation) == []


def test_a_reply_streaming_during_a_crash_survives_as_stopped(path):
    # A real crash: another process writes and dies without closing the connection.
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from tuichat.store import Store
        store = Store(Path({str(path)!r}))
        conversation = store.create_conversation("Crash", "m")
        store.add_message(conversation, "user", "Write a poem")
        reply = store.add_message(conversation, "assistant", "", status="streaming")
        store.update_message(reply, content="Roses are red,")
        store.update_message(reply, content="Roses are red, violets")
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert path.with_name(path.name + "-wal").exists()  # died before any checkpoint

    store = Store(path)
    [conversation] = store.conversations()
    reply = store.messages(conversation.id)[-1]
    assert (reply.content, reply.status) == ("Roses are red, violets", "stopped")
    assert [h.message_id for h in store.search("violets")] == [reply.id]
    store.close()


def test_export_markdown(store):
    conversation = chat(store, "Poems", ("user", "Write a haiku"), ("assistant", "Old pond\nfrog jumps in"), model="qwen")
    cut = store.add_message(conversation, "assistant", "Another one", status="stopped")
    text = store.export_markdown(conversation)
    assert text.startswith("# Poems\n")
    assert "`qwen`" in text
    assert text.index("## User\n\nWrite a haiku") < text.index("## Assistant\n\nOld pond\nfrog jumps in")
    assert "Another one\n\n*(stopped)*" in text
    store.update_message(cut, status="done")
    assert "*(stopped)*" not in store.export_markdown(conversation)


def test_settings_round_trip(path):
    store = Store(path)
    assert store.get_setting("theme") is None
    assert store.get_setting("theme", "tuichat-dark") == "tuichat-dark"
    store.set_setting("theme", "tuichat-light")
    store.set_setting("theme", "tuichat-high-contrast")
    store.close()
    store = Store(path)
    assert store.get_setting("theme", "tuichat-dark") == "tuichat-high-contrast"
    store.close()


def test_open_tabs_keep_their_order(path):
    store = Store(path)
    a, b, c = (store.create_conversation(title, "m") for title in "abc")
    assert [(x.title, x.position, x.is_open) for x in store.conversations()] == [
        ("a", 0, True), ("b", 1, True), ("c", 2, True)
    ]
    store.set_open(b, False)
    assert [x.title for x in store.conversations(open_only=True)] == ["a", "c"]
    assert [x.title for x in store.conversations()] == ["a", "c", "b"]  # closed ones after the tabs
    store.set_open(b, True)  # reopened: last tab
    assert [x.title for x in store.conversations(open_only=True)] == ["a", "c", "b"]
    for position, conversation in enumerate([c, a, b]):  # the user dragged c first
        store.set_open(conversation, True, position)
    store.rename(a, "A")
    store.set_model(a, "other")
    store.close()

    store = Store(path)
    assert [(x.title, x.model) for x in store.conversations(open_only=True)] == [("c", "m"), ("A", "other"), ("b", "m")]
    store.close()


def test_closed_conversations_are_listed_most_recent_first(path):
    clock = Clock(1000.0)
    store = Store(path, clock=clock)
    old = chat(store, "old")
    clock.now += 1
    new = chat(store, "new")
    store.set_open(new, False)
    store.set_open(old, False)
    clock.now += 1
    store.add_message(old, "user", "bump")
    assert [x.title for x in store.conversations()] == ["old", "new"]
    assert store.conversations(open_only=True) == []
    store.close()
