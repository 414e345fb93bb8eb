"""Chat history in one SQLite file: conversations (the open ones are the tabs), their messages, full-text
search over every message, and small key/value settings such as the last theme picked.

The UI writes a streaming reply about once a second, so the connection runs in autocommit mode, in WAL
journal mode with synchronous=NORMAL: each write is one short commit that never waits for an fsync, and a
crash loses at most the last flush, never the file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tuichat import paths

STATUSES = ("done", "streaming", "stopped", "error")
ROLES = ("system", "user", "assistant")


class StoreError(Exception):
    """The history file cannot be used (corrupt, or written by a newer tuichat). The message says which."""


@dataclass
class ConversationRow:
    id: str
    title: str
    model: str
    is_open: bool
    position: int
    created: float
    updated: float


@dataclass
class MessageRow:
    id: int
    conversation_id: str
    role: str
    content: str
    status: str  # one of STATUSES
    created: float
    meta: dict  # metrics of a reply: ttft_ms, tokens_per_s, cached_tokens, ...


@dataclass
class SearchHit:
    conversation_id: str
    message_id: int
    title: str
    role: str
    snippet: str  # one line of plain text around the match, "…" where it was cut


# Schema steps: _MIGRATIONS[n] takes a database from user_version n to n + 1. Append only: files written by
# earlier releases are upgraded by replaying the steps they have not seen.
_MIGRATIONS: list[list[str]] = [
    # 1: the original schema.
    [
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            model TEXT NOT NULL,
            is_open INTEGER NOT NULL DEFAULT 1,
            position INTEGER NOT NULL DEFAULT 0,
            created REAL NOT NULL,
            updated REAL NOT NULL
        )""",
        # AUTOINCREMENT: the UI holds message ids, and a deleted id must never come back as another message.
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'done',
            created REAL NOT NULL
        )""",
        "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
        "CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ],
    # 2: reply metrics, full-text search, and a cheap look-up of replies cut short by a crash.
    [
        "ALTER TABLE messages ADD COLUMN meta TEXT NOT NULL DEFAULT '{}'",
        # External content: the text is stored once, in messages; the triggers keep the index in step.
        """CREATE VIRTUAL TABLE messages_fts USING fts5(
            content, content='messages', content_rowid='id', tokenize='unicode61 remove_diacritics 2'
        )""",
        """CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END""",
        """CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        END""",
        # OF content: the frequent status/meta-only updates leave the index alone.
        """CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END""",
        "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')",
        "CREATE INDEX messages_streaming ON messages(status) WHERE status = 'streaming'",
    ],
]

SCHEMA_VERSION = len(_MIGRATIONS)

_CONVERSATION_COLUMNS = "id, title, model, is_open, position, created, updated"
_MESSAGE_COLUMNS = "id, conversation_id, role, content, status, created, meta"


def _conversation(row: tuple) -> ConversationRow:
    id_, title, model, is_open, position, created, updated = row
    return ConversationRow(id_, title, model, bool(is_open), position, created, updated)


def _message(row: tuple) -> MessageRow:
    *columns, meta = row
    return MessageRow(*columns, meta=json.loads(meta))


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}, not {value!r}")


def _fts_query(text: str) -> str:
    """User text as an FTS5 query that cannot be a syntax error: every word becomes a quoted prefix phrase,
    so quotes, AND/OR/NOT/NEAR, *, -, ^, :, and parentheses are searched as plain text. All words must match;
    the last one may be unfinished (search as you type)."""
    # FTS5 reads the query as a C string: a NUL would end it inside the quotes.
    words = text.replace("\0", " ").split()
    return " ".join('"' + word.replace('"', '""') + '"*' for word in words)


class Store:
    def __init__(self, path: Path | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path or paths.data_dir() / "history.sqlite3"
        self._clock = clock  # the created/updated times; tests set it to see one change
        try:
            # SQLite creates -wal and -shm with the main file's mode, so a 0600 file keeps them private; ones
            # left by a crash of an older tuichat keep their mode and are tightened here.
            os.close(paths.open_private(self.path, os.O_RDONLY))
            for suffix in ("-wal", "-shm"):
                with suppress(FileNotFoundError):
                    paths.make_private(self.path.with_name(self.path.name + suffix))
            # isolation_level=None: autocommit; multi-statement changes use _transaction() explicitly.
            self._conn = sqlite3.connect(self.path, isolation_level=None, timeout=5.0)
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"{self.path} cannot be opened ({error}).") from error
        try:
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._migrate()
            # A reply still "streaming" at open was cut off by a crash or a kill: keep its text as stopped.
            self._conn.execute("UPDATE messages SET status = 'stopped' WHERE status = 'streaming'")
        except BaseException as error:
            self._conn.close()
            if isinstance(error, sqlite3.DatabaseError):
                raise StoreError(f"{self.path} cannot be used as tuichat's history ({error}).") from error
            raise

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front, so a second tuichat waits instead of failing half-way.
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            if self._conn.in_transaction:  # some errors (disk full) already rolled it back
                self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _migrate(self) -> None:
        while True:
            with self._transaction() as conn:
                # Read inside the transaction: another tuichat may have migrated while this one waited.
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise StoreError(
                        f"{self.path} was written by a newer tuichat (schema {version}, this one knows "
                        f"{SCHEMA_VERSION}); upgrade tuichat to open it."
                    )
                if version == SCHEMA_VERSION:
                    return
                for statement in _MIGRATIONS[version]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {version + 1}")

    def _next_position(self) -> int:
        return self._conn.execute(
            "SELECT COALESCE(MAX(position), -1) + 1 FROM conversations WHERE is_open"
        ).fetchone()[0]

    def _changed(self, cursor: sqlite3.Cursor, what: str) -> None:
        if cursor.rowcount == 0:
            raise KeyError(what)

    # Conversations

    def create_conversation(self, title: str, model: str) -> str:
        """A new conversation, open, as the last tab. Returns its id."""
        conversation_id = uuid.uuid4().hex
        now = self._clock()
        self._conn.execute(
            f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, 1, ?, ?, ?)",
            (conversation_id, title, model, self._next_position(), now, now),
        )
        return conversation_id

    def fork(self, conversation_id: str, through: int, title: str) -> str:
        """A new conversation, open, as the last tab: `conversation_id`'s model and its messages up to and
        including message `through`, copied in one transaction. Returns its id."""
        source = self.conversation(conversation_id)
        fork = uuid.uuid4().hex
        now = self._clock()
        with self._transaction() as conn:
            conn.execute(
                f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, 1, ?, ?, ?)",
                (fork, title, source.model, self._next_position(), now, now),
            )
            conn.execute(
                "INSERT INTO messages (conversation_id, role, content, status, created, meta) "
                "SELECT ?, role, content, status, created, meta FROM messages WHERE conversation_id = ? AND id <= ? "
                "ORDER BY id",
                (fork, conversation_id, through),
            )
        return fork

    def conversations(self, open_only: bool = False) -> list[ConversationRow]:
        """The open conversations in tab order (position); then, unless open_only, the closed ones, the most
        recently active first."""
        where = "WHERE is_open" if open_only else ""
        rows = self._conn.execute(
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations {where} "
            "ORDER BY is_open DESC, CASE WHEN is_open THEN position END, updated DESC, rowid DESC"
        )
        return [_conversation(row) for row in rows]

    def conversation(self, conversation_id: str) -> ConversationRow:
        row = self._conn.execute(
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise KeyError(conversation_id)
        return _conversation(row)

    def rename(self, conversation_id: str, title: str) -> None:
        cursor = self._conn.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))
        self._changed(cursor, conversation_id)

    def set_model(self, conversation_id: str, model: str) -> None:
        cursor = self._conn.execute("UPDATE conversations SET model = ? WHERE id = ?", (model, conversation_id))
        self._changed(cursor, conversation_id)

    def set_open(self, conversation_id: str, is_open: bool, position: int | None = None) -> None:
        """Open or close a tab. Reopening without a position puts it last; other tabs keep their positions
        (the UI renumbers them when it reorders)."""
        if position is None and is_open and not self.conversation(conversation_id).is_open:
            position = self._next_position()
        cursor = self._conn.execute(
            "UPDATE conversations SET is_open = ?, position = COALESCE(?, position) WHERE id = ?",
            (is_open, position, conversation_id),
        )
        self._changed(cursor, conversation_id)

    # Messages

    def add_message(
        self,
        conversation_id: str,
        role: str,
        content: str,
        status: str = "done",
        meta: dict | None = None,
    ) -> int:
        _check(role, ROLES, "role")
        _check(status, STATUSES, "status")
        now = self._clock()
        try:
            with self._transaction() as conn:
                cursor = conn.execute(
                    "INSERT INTO messages (conversation_id, role, content, status, created, meta) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (conversation_id, role, content, status, now, json.dumps(meta or {})),
                )
                conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        except sqlite3.IntegrityError as error:  # the foreign key: no such conversation
            raise KeyError(conversation_id) from error
        return cursor.lastrowid

    def update_message(
        self,
        message_id: int,
        content: str | None = None,
        status: str | None = None,
        meta: dict | None = None,
    ) -> None:
        """Change what is given, in one autocommitted statement (the UI calls this about once a second while
        a reply streams). `meta` replaces the whole dict."""
        changes: dict[str, object] = {}
        if content is not None:
            changes["content"] = content
        if status is not None:
            _check(status, STATUSES, "status")
            changes["status"] = status
        if meta is not None:
            changes["meta"] = json.dumps(meta)
        if not changes:
            return
        assignments = ", ".join(f"{column} = ?" for column in changes)
        cursor = self._conn.execute(
            f"UPDATE messages SET {assignments} WHERE id = ?", (*changes.values(), message_id)
        )
        self._changed(cursor, f"message {message_id}")

    def delete_message(self, message_id: int) -> None:
        """Removes the message if it exists (deleting twice is not an error)."""
        self._conn.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, conversation_id: str) -> list[MessageRow]:
        rows = self._conn.execute(
            f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        )
        return [_message(row) for row in rows]

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Messages containing every word of `query` (word prefixes, accents ignored), best matches first."""
        match = _fts_query(query)
        if not match:
            return []
        rows = self._conn.execute(
            """SELECT m.conversation_id, m.id, c.title, m.role, snippet(messages_fts, 0, '', '', '…', 16)
            FROM messages_fts
            JOIN messages AS m ON m.id = messages_fts.rowid
            JOIN conversations AS c ON c.id = m.conversation_id
            WHERE messages_fts MATCH ?
            ORDER BY rank
            LIMIT ?""",
            (match, limit),
        )
        # One line per hit: the snippet may span line breaks of the message.
        return [SearchHit(cid, mid, title, role, " ".join(snippet.split())) for cid, mid, title, role, snippet in rows]

    def export_markdown(self, conversation_id: str) -> str:
        conversation = self.conversation(conversation_id)
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(conversation.created))
        parts = [f"# {conversation.title}", f"Model: `{conversation.model}` · started {started}"]
        for message in self.messages(conversation_id):
            parts.append(f"## {message.role.capitalize()}")
            parts.append(message.content)
            if message.status in ("stopped", "error"):
                parts.append(f"*({message.status})*")
        return "\n\n".join(parts) + "\n"

    # Settings

    def get_setting(self, key: str, default: str | None = None) -> str | None:
        row = self._conn.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return default if row is None else row[0]

    def set_setting(self, key: str, value: str) -> None:
        self._conn.execute(
            "INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def close(self) -> None:
        # SQLite's advice for long-lived connections: refresh the planner statistics when closing.
        self._conn.execute("PRAGMA optimize")
        self._conn.close()
