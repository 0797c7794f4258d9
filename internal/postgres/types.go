package postgres

import (
	"context"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	pgxuuid "github.com/vgarvardt/pgx-google-uuid/v5"
)

// registerTypes teaches a connection the binary form of uuid.UUID. Without
// it pgx reaches a uuid.UUID through database/sql's interfaces: every id
// sent is formatted as text and parsed back (a claim of 200 ids spent
// 400 µs encoding them), every id read is formatted as text and parsed
// again.
func registerTypes(m *pgtype.Map) {
	pgxuuid.Register(m)
	t, _ := m.TypeForOID(pgtype.UUIDOID)
	m.RegisterType(&pgtype.Type{Name: t.Name, OID: t.OID, Codec: uuidCodec{t.Codec}})
}

// uuidCodec reads a binary uuid straight into a *uuid.UUID: pgx would
// otherwise prefer the type's sql.Scanner, which reads text.
type uuidCodec struct{ pgtype.Codec }

func (c uuidCodec) PlanScan(m *pgtype.Map, oid uint32, format int16, target any) pgtype.ScanPlan {
	if _, ok := target.(*uuid.UUID); ok && format == pgtype.BinaryFormatCode {
		return scanBinaryUUID{}
	}
	return c.Codec.PlanScan(m, oid, format, target)
}

type scanBinaryUUID struct{}

func (scanBinaryUUID) Scan(src []byte, dst any) error {
	if src == nil {
		return fmt.Errorf("cannot scan NULL into *uuid.UUID")
	}
	if len(src) != 16 {
		return fmt.Errorf("invalid length for uuid: %d", len(src))
	}
	copy(dst.(*uuid.UUID)[:], src)
	return nil
}

// afterConnect registers the types on a new connection, then runs next
// (when set).
func afterConnect(next func(context.Context, *pgx.Conn) error) func(context.Context, *pgx.Conn) error {
	return func(ctx context.Context, conn *pgx.Conn) error {
		registerTypes(conn.TypeMap())
		if next == nil {
			return nil
		}
		return next(ctx, conn)
	}
}
