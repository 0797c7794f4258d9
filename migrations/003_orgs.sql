-- Organizations, their users, roles and API keys. Every task row carries its
-- org; the API reads and writes task and org rows as the role
-- conveyor_tenant, under row-level security keyed on the org it sets for
-- each transaction (docs/design.md, "Tenancy").

CREATE TABLE orgs (
    id         uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    slug       text        NOT NULL UNIQUE CHECK (slug ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
    name       text        NOT NULL,
    settings   jsonb       NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now()
);

-- People, known by their identity provider's subject. role is what they may
-- do in their org: read, also write, also administer.
CREATE TABLE users (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id      uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    external_id text        NOT NULL UNIQUE CHECK (length(external_id) BETWEEN 1 AND 255),
    email       text,
    role        text        NOT NULL CHECK (role IN ('reader', 'writer', 'admin')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, id)
);

-- Roles an org defines to restrict who sees a task (a task's visibility).
CREATE TABLE org_roles (
    id         uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id     uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    slug       text        NOT NULL CHECK (slug ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
    name       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, slug),
    UNIQUE (org_id, id)
);

CREATE TABLE org_role_memberships (
    role_id    uuid        NOT NULL,
    user_id    uuid        NOT NULL,
    org_id     uuid        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role_id, user_id),
    FOREIGN KEY (org_id, role_id) REFERENCES org_roles (org_id, id) ON DELETE CASCADE,
    FOREIGN KEY (org_id, user_id) REFERENCES users (org_id, id) ON DELETE CASCADE
);
CREATE INDEX org_role_memberships_user ON org_role_memberships (user_id);

-- Keys for services. The secret is shown once and kept only as its SHA-256
-- (a 256-bit random secret needs no slow hash); prefix finds the row.
CREATE TABLE api_keys (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id       uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    name         text        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    role         text        NOT NULL CHECK (role IN ('reader', 'writer', 'admin')),
    prefix       text        NOT NULL UNIQUE,
    secret_hash  bytea       NOT NULL,
    created_by   jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz,
    last_used_at timestamptz,
    revoked_at   timestamptz,
    UNIQUE (org_id, id)
);
CREATE INDEX api_keys_org ON api_keys (org_id, created_at DESC);

-- The org roles of a key: a service may see, and submit, restricted tasks.
CREATE TABLE api_key_roles (
    key_id  uuid NOT NULL,
    role_id uuid NOT NULL,
    org_id  uuid NOT NULL,
    PRIMARY KEY (key_id, role_id),
    FOREIGN KEY (org_id, key_id) REFERENCES api_keys (org_id, id) ON DELETE CASCADE,
    FOREIGN KEY (org_id, role_id) REFERENCES org_roles (org_id, id) ON DELETE CASCADE
);
CREATE INDEX api_key_roles_role ON api_key_roles (role_id);

-- The task types each org has submitted while no worker had declared them:
-- the API bounds how many of those an org may have waiting at once.
CREATE TABLE org_task_types (
    org_id        uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    type          text        NOT NULL,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, type)
);

-- Existing tasks move into an org per former tenant (all of them were in
-- 'default'), made only when there are rows to move.
INSERT INTO orgs (slug, name)
SELECT DISTINCT left(regexp_replace(lower(tenant_id), '[^a-z0-9-]+', '-', 'g'), 63), tenant_id FROM tasks
UNION
SELECT DISTINCT left(regexp_replace(lower(tenant_id), '[^a-z0-9-]+', '-', 'g'), 63), tenant_id FROM task_idempotency_keys
ON CONFLICT (slug) DO NOTHING;

-- org_id has no foreign key on the task tables: a key check on every insert
-- would lock the org's row from every submitting transaction. Orgs are not
-- deleted while they have tasks.
ALTER TABLE tasks
    ADD COLUMN org_id     uuid,
    ADD COLUMN visibility text[] NOT NULL DEFAULT '{}';
UPDATE tasks t SET org_id = o.id FROM orgs o
    WHERE o.slug = left(regexp_replace(lower(t.tenant_id), '[^a-z0-9-]+', '-', 'g'), 63);
ALTER TABLE tasks ALTER COLUMN org_id SET NOT NULL;

DROP INDEX tasks_input_hash_key;
CREATE UNIQUE INDEX tasks_input_hash_key ON tasks (org_id, type, input_hash) WHERE input_hash IS NOT NULL;
DROP INDEX tasks_type_id;
CREATE INDEX tasks_org_id ON tasks (org_id, id DESC);
CREATE INDEX tasks_org_type_id ON tasks (org_id, type, id DESC);
ALTER TABLE tasks DROP COLUMN tenant_id;

ALTER TABLE task_idempotency_keys ADD COLUMN org_id uuid;
UPDATE task_idempotency_keys k SET org_id = o.id FROM orgs o
    WHERE o.slug = left(regexp_replace(lower(k.tenant_id), '[^a-z0-9-]+', '-', 'g'), 63);
ALTER TABLE task_idempotency_keys
    DROP CONSTRAINT task_idempotency_keys_pkey,
    DROP COLUMN tenant_id,
    ALTER COLUMN org_id SET NOT NULL,
    ADD PRIMARY KEY (org_id, type, key);

-- Who made a change through the API: {"kind": "user"|"key", "id", "name"}.
ALTER TABLE task_events ADD COLUMN org_id uuid, ADD COLUMN principal jsonb;
UPDATE task_events e SET org_id = t.org_id FROM tasks t WHERE t.id = e.task_id;
ALTER TABLE task_events ALTER COLUMN org_id SET NOT NULL;

ALTER TABLE task_results ADD COLUMN org_id uuid;
UPDATE task_results r SET org_id = t.org_id FROM tasks t WHERE t.id = r.task_id;
ALTER TABLE task_results ALTER COLUMN org_id SET NOT NULL;

-- Outbox rows of tasks already gone (retention) cannot be placed; they
-- would only publish messages for nothing.
DELETE FROM outbox o WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = o.task_id);
ALTER TABLE outbox ADD COLUMN org_id uuid;
UPDATE outbox o SET org_id = t.org_id FROM tasks t WHERE t.id = o.task_id;
ALTER TABLE outbox ALTER COLUMN org_id SET NOT NULL;

-- The role the API takes for org-scoped work. Roles belong to the cluster,
-- so another database may have made it already.
DO $$
BEGIN
    CREATE ROLE conveyor_tenant NOLOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;
END
$$;
DO $$
BEGIN
    IF NOT pg_has_role(current_user, 'conveyor_tenant', 'MEMBER') THEN
        EXECUTE format('GRANT conveyor_tenant TO %I', current_user);
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO conveyor_tenant', current_schema());
END
$$;

GRANT SELECT ON orgs, task_types TO conveyor_tenant;
GRANT SELECT, INSERT, UPDATE ON tasks, task_events, task_results, task_idempotency_keys TO conveyor_tenant;
GRANT INSERT ON outbox TO conveyor_tenant;
GRANT SELECT, INSERT ON org_task_types TO conveyor_tenant;
GRANT SELECT, INSERT, UPDATE, DELETE ON users, org_roles, org_role_memberships, api_keys, api_key_roles
    TO conveyor_tenant;
GRANT USAGE ON SEQUENCE task_events_id_seq, outbox_id_seq TO conveyor_tenant;

-- The caller of the transaction: its org, the org roles whose restricted
-- tasks it sees, and whether it sees all of them (an admin). Unset, they
-- match nothing.
CREATE FUNCTION conveyor_org() RETURNS uuid LANGUAGE sql STABLE
    AS $$ SELECT nullif(current_setting('conveyor.org_id', true), '')::uuid $$;
CREATE FUNCTION conveyor_sees(visibility text[]) RETURNS boolean LANGUAGE sql STABLE
    AS $$ SELECT visibility = '{}' OR current_setting('conveyor.see_all', true) = 'on'
        OR visibility && string_to_array(nullif(current_setting('conveyor.roles', true), ''), ',') $$;

ALTER TABLE tasks ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON tasks TO conveyor_tenant
    USING (org_id = conveyor_org() AND conveyor_sees(visibility));

-- A task's rows follow the task: a caller who cannot see the task sees
-- none of its events or result. Writes need only the org (the task being
-- written in the same statement is not visible to the check yet).
ALTER TABLE task_events ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON task_events TO conveyor_tenant
    USING (org_id = conveyor_org() AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = task_id))
    WITH CHECK (org_id = conveyor_org());
ALTER TABLE task_results ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON task_results TO conveyor_tenant
    USING (org_id = conveyor_org() AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = task_id))
    WITH CHECK (org_id = conveyor_org());
ALTER TABLE outbox ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON outbox TO conveyor_tenant WITH CHECK (org_id = conveyor_org());

ALTER TABLE task_idempotency_keys ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON task_idempotency_keys TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE orgs ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON orgs TO conveyor_tenant USING (id = conveyor_org());
ALTER TABLE users ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON users TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE org_roles ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON org_roles TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE org_role_memberships ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON org_role_memberships TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE api_keys ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON api_keys TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE org_task_types ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON org_task_types TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE api_key_roles ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON api_key_roles TO conveyor_tenant USING (org_id = conveyor_org());
